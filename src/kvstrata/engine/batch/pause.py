"""A step given up for a more urgent row, kept where it was to go on later (a paused step).

A step is given up at the next layer when a more urgent row gets ready (the stepper's
``interrupt``). Before 2026-12-07 everything it had computed was thrown away and its rows ran
again from the start; a background prefill chunk (up to ~90 ms on SmolLM2 with two cores) then
cost its share of the machine each time. Now, on the written-out Llama path
(:mod:`.llama`), the prefill rows that may pause keep the layers they finished: their keys and
values of those layers stay appended, and the residual stream the next layer starts from (their
slice of the packed tokens) is kept here; the other rows of the step (decodes, rows that may not
pause) are rolled back as before. The urgent row runs in the next step; the paused rows then run
the layers left (:meth:`~kvstrata.engine.batch.forward.BatchedForward.resume`), which may be
given up again. Until it resumes, a paused row's layers hold different numbers of tokens: nothing
else reads the row (the loop holds it out of every step; a request cancelled meanwhile rolls the
paused step back whole).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstrata.engine.batch.attention import AttendingRow, StepInterrupted


class LayersInterrupted(StepInterrupted):
    """A step of the written-out path given up at decoder layer ``layer``: the residual stream that
    layer started from (``hidden``, the step's packed tokens), its normed input ``x`` and the
    rotary tables. Layer ``layer``'s keys and values were already appended."""

    def __init__(self, message: str, layer: int, *state: torch.Tensor) -> None:
        super().__init__(message)
        self.layer = layer
        self.hidden, self.x, self.cos, self.sin = state


@dataclass(slots=True)
class PausedStep:
    """The rows of a paused step, and what their next layer starts from."""

    rows: list[AttendingRow]
    sizes: list[int]
    """Each row's new tokens in the step."""
    logits: list[bool]
    """Whether the step returns each row's logits."""
    lengths: list[int]
    """Each row's tokens before the step (its layers from ``layer`` on hold that many)."""
    layer: int
    hidden: torch.Tensor
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    keep: torch.Tensor
    """Where the segments that return logits end, in the paused rows' packed tokens."""

    def update(self, exc: LayersInterrupted) -> None:
        """Given up again, at ``exc.layer``: crop that layer's appends, keep its inputs."""
        self.layer, self.hidden, self.x = exc.layer, exc.hidden, exc.x
        for row, length in zip(self.rows, self.lengths, strict=True):
            crop_from(row, length, exc.layer)

    def roll_back(self) -> None:
        """Every row as it was before the step."""
        for row, length in zip(self.rows, self.lengths, strict=True):
            crop_from(row, length, 0)


class StepPaused(StepInterrupted):
    """A step given up with some of its rows paused (:class:`PausedStep`), the others rolled back."""

    def __init__(self, message: str, paused: PausedStep) -> None:
        super().__init__(message)
        self.paused = paused


def crop_from(row: AttendingRow, length: int, layer: int) -> None:
    """Layers ``layer ..`` of ``row`` back to ``length`` tokens."""
    for cache_layer in row.cache.layers[layer:]:
        extra = cache_layer.get_seq_length() - length
        if extra > 0:
            cache_layer.crop(-extra)


def pause(
    exc: LayersInterrupted,
    rows: Sequence[AttendingRow],
    sizes: Sequence[int],
    logits: Sequence[bool],
    lengths: Sequence[int],
    pausable: Sequence[bool],
) -> PausedStep:
    """The paused step of the ``pausable`` rows of a step given up as ``exc`` says (their layer
    ``exc.layer`` cropped; ``sizes``: each row's new tokens in packed order, ``logits``: whether
    the step returns its logits); the caller rolls the other rows back."""
    chosen = [i for i, may in enumerate(pausable) if may]
    starts = [sum(sizes[:i]) for i in chosen]
    index = [t for i, first in zip(chosen, starts, strict=True) for t in range(first, first + sizes[i])]
    ends = list(itertools.accumulate(sizes[i] for i in chosen))
    keep = [end - 1 for i, end in zip(chosen, ends, strict=True) if logits[i]]
    for i in chosen:
        crop_from(rows[i], lengths[i], exc.layer)
    at = torch.tensor(index, dtype=torch.long, device=exc.hidden.device)
    return PausedStep(
        [rows[i] for i in chosen],
        [sizes[i] for i in chosen],
        [logits[i] for i in chosen],
        [lengths[i] for i in chosen],
        exc.layer,
        exc.hidden.index_select(1, at),
        exc.x.index_select(1, at),
        exc.cos.index_select(0, at),
        exc.sin.index_select(0, at),
        torch.tensor(keep, dtype=torch.long, device=exc.hidden.device),
    )
