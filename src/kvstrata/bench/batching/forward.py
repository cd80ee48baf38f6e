"""The forward mode of ``kvstrata bench batching``: N sessions' decode steps through the batched
forward pass alone (:class:`~kvstrata.engine.batch.BatchedForward`), against one-sequence
forwards (``serial``) and the padded layout (``padded``); see :mod:`kvstrata.bench.batching.runner`."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from kvstrata.bench.common.measure import percentile, rotate

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel

SERIAL, BATCHED, PADDED = "serial", "batched", "padded"


def prefill(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    from kvstrata.bench.common.models import prefill_kv

    return prefill_kv(loaded, token_ids)[0]


def cache(kv: torch.Tensor, length: int, extra: int) -> Any:
    from kvstrata.integrations.transformers.cache import KVStrataCache

    return KVStrataCache.from_kv(kv[:, :, :, :length], extra_tokens=extra)


class _Serial:
    """Each session in turn, a one-token forward on its own cache (the engine's step today)."""

    def __init__(self, model: Any, kv: torch.Tensor, text: list[int], lengths: list[int], steps: int) -> None:
        self.model = model
        self.caches = [cache(kv, length, steps + 1) for length in lengths]
        self.feed = [text[length] for length in lengths]
        self.tokens: list[list[int]] = [[] for _ in lengths]
        self.step_s: list[float] = []  # one session's step: what its client waits per token
        self.round_s: list[float] = []  # every session's step

    def step(self) -> None:
        import torch

        round_started = time.perf_counter()
        for i, cache in enumerate(self.caches):
            started = time.perf_counter()
            ids = torch.tensor([[self.feed[i]]], dtype=torch.long)
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            self.feed[i] = int(out.logits[0, -1].float().argmax())
            self.step_s.append(time.perf_counter() - started)
            self.tokens[i].append(self.feed[i])
        self.round_s.append(time.perf_counter() - round_started)


class _Batched:
    """All sessions in one forward pass of packed rows."""

    def __init__(self, model: Any, kv: torch.Tensor, text: list[int], lengths: list[int], steps: int) -> None:
        from kvstrata.engine.batch import BatchedForward, BatchRow

        self.forward = BatchedForward(model)
        self.kv, self.text = kv, text
        self.rows = [BatchRow(cache(kv, length, steps + 2)) for length in lengths]
        self.feed = [text[length] for length in lengths]
        self.tokens: list[list[int]] = [[] for _ in lengths]
        self.step_s: list[float] = []
        self.round_s = self.step_s

    def step(self) -> None:
        from kvstrata.engine.batch import Segment

        started = time.perf_counter()
        logits = self.forward.forward([Segment(r, [t]) for r, t in zip(self.rows, self.feed, strict=True)])
        self.feed = [int(row_logits.argmax()) for row_logits in logits if row_logits is not None]
        self.step_s.append(time.perf_counter() - started)
        for picked, token in zip(self.tokens, self.feed, strict=True):
            picked.append(token)

    def mixed_step(self, chunk: int) -> float:
        """One step more, with a newcomer prefilling ``chunk`` tokens beside the decoders."""
        from kvstrata.engine.batch import BatchRow, Segment

        newcomer = BatchRow(cache(self.kv, 0, chunk + 1))
        segments = [Segment(r, [t]) for r, t in zip(self.rows, self.feed, strict=True)]
        started = time.perf_counter()
        self.forward.forward([*segments, Segment(newcomer, self.text[:chunk])])
        return time.perf_counter() - started


class _Padded:
    """All histories left-padded to the longest in one (N, H, Lmax, D) cache, with a mask."""

    def __init__(self, model: Any, kv: torch.Tensor, text: list[int], lengths: list[int], steps: int) -> None:
        import torch
        from transformers import DynamicCache

        self.model, self.lengths = model, lengths
        n, longest = len(lengths), max(lengths)
        started = time.perf_counter()
        self.cache = DynamicCache(config=model.config)
        for layer in range(kv.shape[1]):
            shape = (n, kv.shape[2], longest, kv.shape[4])
            keys, values = kv.new_zeros(shape), kv.new_zeros(shape)
            for i, length in enumerate(lengths):  # left padding: every row ends at the same slot
                keys[i, :, longest - length :] = kv[0, layer, :, :length]
                values[i, :, longest - length :] = kv[1, layer, :, :length]
            self.cache.update(keys, values, layer)
        self.mask = torch.zeros(n, longest, dtype=torch.long)
        for i, length in enumerate(lengths):
            self.mask[i, longest - length :] = 1
        self.build_s = time.perf_counter() - started
        self.feed = [text[length] for length in lengths]
        self.tokens: list[list[int]] = [[] for _ in lengths]
        self.step_s: list[float] = []
        self.round_s = self.step_s

    def step(self) -> None:
        import torch

        started = time.perf_counter()
        n, done = len(self.lengths), len(self.step_s)
        self.mask = torch.cat([self.mask, torch.ones(n, 1, dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=torch.tensor([[t] for t in self.feed]),
            attention_mask=self.mask,
            position_ids=torch.tensor([[length + done] for length in self.lengths]),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.feed = [int(t) for t in out.logits[:, -1].float().argmax(dim=-1).tolist()]
        self.step_s.append(time.perf_counter() - started)
        for picked, token in zip(self.tokens, self.feed, strict=True):
            picked.append(token)


_VARIANTS = {SERIAL: _Serial, BATCHED: _Batched, PADDED: _Padded}


def measure(
    model: Any,
    kv: torch.Tensor,
    text: list[int],
    lengths: list[int],
    steps: int,
    chunk: int,
    variants: list[str],
    advance: Any,
) -> dict[str, Any]:
    """Every variant decodes the same steps, interleaved step by step (in an order that rotates),
    so that a load from elsewhere on the machine falls on all of them alike."""
    decoders = {v: _VARIANTS[v](model, kv, text, lengths, steps) for v in variants}
    for step in range(steps):
        for variant in rotate(variants, step):
            decoders[variant].step()
        advance()
    entry: dict[str, Any] = {"histories": lengths}
    for variant, decoder in decoders.items():
        entry[variant] = {"step_s": decoder.step_s, "round_s": decoder.round_s, "tokens": decoder.tokens}
    entry[BATCHED]["mixed_step_s"] = decoders[BATCHED].mixed_step(chunk)
    if PADDED in decoders:
        entry[PADDED]["build_s"] = decoders[PADDED].build_s
    return entry


def summarize(entry: dict[str, Any], n: int, steps: int) -> dict[str, Any]:
    serial = entry[SERIAL]
    out: dict[str, Any] = {"sessions": n, "histories": entry["histories"], "steps": steps}
    for variant in (SERIAL, BATCHED, PADDED):
        if variant not in entry:
            continue
        measured = entry[variant]
        total = sum(measured["round_s"])
        stats = {
            "tokens_per_s": n * steps / total,
            "itl_median_s": statistics.median(measured["step_s"]),
            "itl_p90_s": percentile(measured["step_s"], 90),
            "step_s": measured["step_s"],
            "round_s": measured["round_s"],
            "speedup": sum(serial["round_s"]) / total,
            "speedup_median": statistics.median(serial["round_s"]) / statistics.median(measured["round_s"]),
            "same_tokens": measured["tokens"] == serial["tokens"],
            "tokens_agreeing": _agreement(measured["tokens"], serial["tokens"]),
        }
        for extra in ("mixed_step_s", "build_s"):
            if extra in measured:
                stats[extra] = measured[extra]
        out[variant] = stats
    return out


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of tokens equal up to each row's first difference (greedy paths diverge after it)."""
    total = sum(len(w) for w in want)
    same = 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            if a != b:
                break
            same += 1
    return same / total if total else 1.0
