"""One model forward pass for many sessions at once: packed ("varlen") rows, per-row attention.

Every row (a session's request) brings its own new tokens to a step: one token when it decodes,
a chunk of its prompt when it prefills. All rows' tokens are packed into ONE sequence
``(1, T)`` with explicit per-token ``position_ids`` (vLLM's varlen layout), so the linear layers,
which are most of the cost of a step on a CPU (they read every weight once per step), run once
for all rows. Attention is the only per-row part: a registered attention function runs each
row's queries against that row's own keys and values, which stay in the row's
:class:`~kvstrata.integrations.transformers.cache.KVStrataCache` (a growable buffer per layer).
So a row is exactly what the single-request engine already builds: a cache restored from the
store (``cache_for`` / ``KVStrataCache.from_loaded``), appended to in place, and committed back
with the same ``commit`` path when its request ends. Rows join and leave between steps without
touching other rows' KV.

How a step reaches the rows, and what each row's attention is (exact tokens, and blocks held
encoded that the native decode kernel reads in place): :mod:`.attention`.

Why not transformers' continuous batching (``transformers.generation.continuous_batching``,
5.24): it is a complete serving loop (``ContinuousBatchingManager`` with its own thread,
FIFO/prefill-first schedulers, logits processors and sampling) over a ``PagedAttentionCache``
that owns ONE flat paged tensor for all requests and allocates its pages itself. It does not
fit kvstrata's tiered cache: (1) a session's KV arrives from the store as a contiguous buffer
(often adopted without a copy, ``from_loaded``) and must go back through ``commit``; in the
paged cache it would be copied into pages on every join and gathered out again on every commit,
and the cache's memory would be a second, separately sized pool beside the store's L1; (2) on
CPU its attention path is "index" mode: every layer of every step gathers ALL rows' KV into one
packed tensor through ``read_index`` and attends with a block-diagonal mask of (new tokens x all
rows' tokens), a full copy of the batch's KV per layer per step, where per-row attention reads
each row's KV in place; (3) its schedulers have no priority classes, preemption of background
work or starvation guard, and its generation loop has no hook for kvstrata's per-request
decoding (stop strings, grammars), prefix restore or commit. What we do take from it is the
layout: packed tokens with explicit positions, ``logits_to_keep`` as the indices of each row's
last token, and KV handed over through the cache's ``update`` and the attention kwargs.

The other layout, padding every row to the longest history (``(B, H, Lmax, D)`` plus an
attention mask), was measured against this one with ``kvstrata bench batching --padded``
(SmolLM2, histories of 128..1024 tokens, one thread of a shared 2-core CPU, 2026-11-30): at 16
sessions packed rows decoded 57.9 tok/s against 39.4 padded in fp32 and 90.6 against 66.7 in
bf16, at 32 sessions 76.1 against 35.4 (fp32). Padding also copies every row's KV into the
shared batch tensor (0.7 s at 16 sessions in fp32), again whenever a row joins or leaves, and
pads short rows to the longest; packed rows copy nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from kvstrata.engine.batch import decode_kernel, llama
from kvstrata.engine.batch.attention import (
    ATTENTION_NAME,
    STEP_KWARG,
    Step,
    StepCache,
    StepInterrupted,
    batched_attention,
    row_mask,
)
from kvstrata.engine.batch.llama import TorchOps
from kvstrata.engine.batch.pause import LayersInterrupted, PausedStep, StepPaused, crop_from, pause
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.cache import KVStrataCache, layer_devices

_BASE_IMPLEMENTATIONS = ("eager", "sdpa")
KERNEL_LOAD_WAIT_S = 60.0
"""How long a new :class:`BatchedForward` waits for a native module that is already built (a load
takes tens of milliseconds; where torch's loader finds a source changed, it recompiles: the steps
then start with torch's operators after this wait)."""
__all__ = ["BatchRow", "BatchedForward", "Segment", "StepInterrupted"]


class BatchRow:
    """One sequence of the batch: its KV cache (all of its history) and the positions it uses.

    ``position_offset``: how far the row's positions lie past its cache slots (a lossy memory
    mode keeps the original positions of a pruned prefix; its new tokens continue from there).
    ``track_attention``: accumulate, per cache slot, the attention probability mass the slot
    received (summed over layers, heads and queries), for importance-aware eviction and grading.
    A decode step adds it up in the native kernel as a by-product of its softmax (about 1% of
    the kernel's time; ``kvstrata bench pool``); a prefill step, or a decode step without the
    kernel, runs eager attention for the row, which returns the probabilities.
    """

    def __init__(
        self, cache: KVStrataCache, *, position_offset: int = 0, track_attention: bool = False
    ) -> None:
        if position_offset < 0:
            raise ConfigError(f"position_offset must be >= 0, got {position_offset}")
        self.cache = cache
        self.position_offset = position_offset
        self.attention_mass: torch.Tensor | None = (
            torch.zeros(0, dtype=torch.float64) if track_attention else None
        )
        self._kernel_mass = torch.empty(0)
        """What the kernel added up, float32 ``(kv_heads, slots)``: folded into ``attention_mass``
        when it is read."""

    @classmethod
    def empty(cls, model: torch.nn.Module, **kwargs: Any) -> BatchRow:
        """A row with no history (its layers on the model's decoder layers' devices)."""
        return cls(KVStrataCache.from_kv(None, devices=layer_devices(model)), **kwargs)

    @property
    def length(self) -> int:
        """Tokens whose KV the row holds (its cache slots)."""
        return self.cache.get_seq_length()

    @property
    def next_position(self) -> int:
        return self.length + self.position_offset

    def block_mass(self, block_tokens: int, num_blocks: int | None = None) -> torch.Tensor:
        """The tracked attention mass folded per block of ``block_tokens`` tokens of the sequence
        (float64); slots of encoded blocks count for the positions they hold."""
        if self.attention_mass is None:
            raise ConfigError("this row does not track attention (track_attention=False)")
        self._fold_kernel_mass()
        mass = self.attention_mass
        if self.cache.pages is not None and len(self.cache.pages):
            positions = self.cache.slot_positions()
            n = min(mass.numel(), positions.numel())
            logical = torch.zeros(positions.numel(), dtype=torch.float64)
            logical[positions[:n]] = mass[:n]
            mass = logical
        blocks = (mass.numel() + block_tokens - 1) // block_tokens if num_blocks is None else num_blocks
        out = torch.zeros(blocks, dtype=torch.float64)
        n = min(mass.numel(), blocks * block_tokens)
        out.index_add_(0, torch.arange(n) // block_tokens, mass[:n])
        return out

    def kernel_mass_buffer(self) -> torch.Tensor:
        """Where the kernel adds this row's attention mass in its next decode step: float32
        ``(kv_heads, >= slots + 1)``; empty when the row tracks none (or has no history yet)."""
        layer = self.cache.layers[0]
        if self.attention_mass is None or layer.keys is None:
            return torch.empty(0)
        heads, needed = layer.keys.shape[1], self.length + 1
        if self._kernel_mass.dim() != 2 or self._kernel_mass.shape[1] < needed:
            grown = torch.zeros(heads, max(needed, 2 * self._kernel_mass.shape[-1], 64))
            if self._kernel_mass.dim() == 2:
                grown[:, : self._kernel_mass.shape[1]] = self._kernel_mass
            self._kernel_mass = grown
        return self._kernel_mass

    def _fold_kernel_mass(self) -> None:
        if self._kernel_mass.dim() != 2:
            return
        self.add_per_slot(self._kernel_mass[:, : self.length].to(torch.float64).sum(dim=0))
        self._kernel_mass = torch.zeros_like(self._kernel_mass)  # not zero_(): it may be an inference tensor

    def add_attention(self, weights: torch.Tensor) -> None:
        """Add eager attention's probabilities ``(1, heads, queries, slots)``."""
        self.add_per_slot(weights.detach().to(torch.float64).sum(dim=(0, 1, 2)).cpu())

    def add_per_slot(self, per_slot: torch.Tensor) -> None:
        assert self.attention_mass is not None
        if per_slot.numel() > self.attention_mass.numel():
            grown = torch.zeros(per_slot.numel(), dtype=torch.float64)
            grown[: self.attention_mass.numel()] = self.attention_mass
            self.attention_mass = grown
        self.attention_mass[: per_slot.numel()] += per_slot


@dataclass(frozen=True, slots=True)
class Segment:
    """A row's share of one step: its new tokens, and whether the step returns the logits after
    the last of them (False for a prefill chunk that is not the prompt's last)."""

    row: BatchRow
    token_ids: Sequence[int]
    logits: bool = True


class BatchedForward:
    """Runs steps of many rows through one causal LM (Llama family, eager or sdpa attention).

    Not thread-safe, and the model's attention implementation is switched for the duration of
    each step: run steps on the thread (or under the lock) that owns the model.
    """

    def __init__(
        self, model: torch.nn.Module, attention: str | None = None, *, direct_llama: bool = True
    ) -> None:
        """``attention``: the per-row attention, ``eager`` or ``sdpa`` (default: the model's own).
        Rows that track attention always use eager (it returns the probabilities).
        ``direct_llama``: run Llama models' steps written out (:mod:`.llama`; same logits, less
        Python per layer); False runs every model through its own forward."""
        base = attention or model.config._attn_implementation
        if base not in _BASE_IMPLEMENTATIONS:
            raise ConfigError(
                f"batched steps need eager or sdpa attention, not {base!r} (pass attention='sdpa')"
            )
        self.model = model
        self.base_attention = base
        self.num_layers = len(layer_devices(model))
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self._input_device = model.get_input_embeddings().weight.device
        self._native = (
            base == "sdpa"
            and model.dtype in (torch.float32, torch.bfloat16)
            and all(device.type == "cpu" for device in layer_devices(model))
            and decode_kernel.fits(model.config)
        )
        self._llama = llama.LlamaStep(model) if direct_llama and llama.supports(model) else None
        """The step written out for Llama models (:mod:`.llama`); others run the model's forward."""
        self._native_ops = (
            self._llama is not None
            and model.dtype in (torch.float32, torch.bfloat16)
            and all(device.type == "cpu" for device in layer_devices(model))
        )
        """The Llama step's elementwise operations from the native module once it is loaded."""
        if self._native or self._native_ops:
            decode_kernel.start()  # in the background; torch's operators until it is loaded
            if decode_kernel.built():
                # Built before: load it before the first step, so that every step of this process
                # runs one implementation. A first step with torch's operators and the rest with
                # the kernel gave a request KV that differed by float rounding from the same
                # request's a moment later (a server's first request against its second).
                decode_kernel.load(timeout=KERNEL_LOAD_WAIT_S)
        AttentionInterface.register(ATTENTION_NAME, batched_attention)  # idempotent
        self._checked_attention: set[str] = set()
        configs = [model.config, *(m.config for m in model.modules() if isinstance(m, PreTrainedModel))]
        self._attention_configs = list({id(c): c for c in configs}.values())

    @torch.inference_mode()
    def forward(
        self,
        segments: Sequence[Segment],
        interrupt: Callable[[], bool] | None = None,
        pausable: Sequence[bool] = (),
    ) -> list[torch.Tensor | None]:
        """Run one step; returns, per segment, the float32 logits after its last token (None for
        a segment that asked for none). On an error every row is left as it was before the step.

        ``interrupt`` is asked before each layer's attention whether to give the step up (raising
        :class:`StepInterrupted`): a realtime request that became ready while a long step of
        other rows runs then waits for one layer, not for the rest of the step. What was computed
        of the step is thrown away: at most one step per realtime arrival, but for the segments
        ``pausable`` names (on the written-out Llama path): their finished layers are kept and
        :class:`~kvstrata.engine.batch.pause.StepPaused` says where to go on (:meth:`resume`)."""
        rows, sizes, ids, positions, keep = self._pack(segments)
        if not rows:
            return []
        step = Step(rows, sizes, self.base_attention, self.num_layers, interrupt)
        kernel = decode_kernel.loaded() if self._native else None
        if kernel is not None:
            step.plan_native(kernel, self._input_device)
        dtype = self.model.dtype
        for row, n_new in zip(rows, sizes, strict=True):
            mask = row_mask(n_new, row.length + n_new, dtype, self._input_device, self.base_attention)
            step.masks.append(mask)
        lengths = [row.length for row in rows]
        device = self._input_device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)
        logits_to_keep = torch.tensor(keep or [len(ids) - 1], dtype=torch.long, device=device)
        try:
            if self._llama is not None:
                ops = decode_kernel.loaded() if self._native_ops else None
                out = self._llama(step, input_ids, position_ids, logits_to_keep, ops)
            else:
                out = self._model_forward(step, input_ids, position_ids, logits_to_keep)
        except LayersInterrupted as exc:
            if not any(pausable):
                for row, length in zip(rows, lengths, strict=True):
                    crop_from(row, length, 0)
                raise
            wants = [segment.logits for segment in segments]
            paused = pause(exc, rows, sizes, wants, lengths, pausable)
            for row, length, may in zip(rows, lengths, pausable, strict=True):
                if not may:
                    crop_from(row, length, 0)
            raise StepPaused(str(exc), paused) from None
        except BaseException:
            for row, length in zip(rows, lengths, strict=True):
                crop_from(row, length, 0)
            raise
        return _per_segment(out, [segment.logits for segment in segments])

    @torch.inference_mode()
    def resume(
        self, paused: PausedStep, interrupt: Callable[[], bool] | None = None
    ) -> list[torch.Tensor | None]:
        """The rest of a paused step (:mod:`.pause`): its rows' layers from ``paused.layer`` on;
        per segment, as :meth:`forward` returns. Given up again, ``paused`` is updated and
        :class:`StepPaused` raised; on an error every row is rolled back to before the step."""
        assert self._llama is not None
        rows, sizes = paused.rows, paused.sizes
        step = Step(rows, sizes, self.base_attention, self.num_layers, interrupt)  # type: ignore[arg-type]
        for n_new, length in zip(sizes, paused.lengths, strict=True):
            step.masks.append(
                row_mask(n_new, length + n_new, self.model.dtype, self._input_device, self.base_attention)
            )
        ops = decode_kernel.loaded() if self._native_ops else None
        state = (paused.hidden, paused.x, paused.cos, paused.sin)
        try:
            out = self._llama.layers(
                step, StepCache(step, ops), state, paused.keep, ops or TorchOps, paused.layer
            )
        except LayersInterrupted as exc:
            paused.update(exc)
            raise StepPaused(str(exc), paused) from None
        except BaseException:
            paused.roll_back()
            raise
        return _per_segment(out, paused.logits)

    def _model_forward(
        self, step: Step, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The step through the model's own forward, its attention switched to the batched one."""
        previous = self.model.config._attn_implementation
        try:
            self._set_attention(ATTENTION_NAME)
            return self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                cache=StepCache(step, step.kernel),  # the native module when it is in use
                use_cache=True,
                logits_to_keep=keep,
                **{STEP_KWARG: step},
            ).logits
        finally:
            self._set_attention(previous)

    def _set_attention(self, name: str) -> None:
        """Switch the model's attention implementation to ``name``. transformers'
        ``set_attn_implementation`` checks the name and walks every module for sub-models each
        time (0.4 ms a step, two calls, against a one-row fp32 SmolLM2 step of 28 ms); so it runs
        once per name, and later switches set the configs it found (the attention layers read
        the implementation from them at every call)."""
        if name not in self._checked_attention:
            self.model.set_attn_implementation(name)
            self._checked_attention.add(name)
            return
        for config in self._attention_configs:
            config._attn_implementation_internal = name

    def _pack(
        self, segments: Sequence[Segment]
    ) -> tuple[list[BatchRow], list[int], list[int], list[int], list[int]]:
        rows: list[BatchRow] = []
        sizes: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        seen: set[int] = set()
        for segment in segments:
            row, tokens = segment.row, list(segment.token_ids)
            if not tokens:
                raise ConfigError("a segment needs at least one token")
            if id(row) in seen:
                raise ConfigError("a row appears twice in one step")
            seen.add(id(row))
            if len(row.cache.layers) != self.num_layers:
                raise ConfigError(
                    f"a row's cache has {len(row.cache.layers)} layers, the model {self.num_layers}"
                )
            first = row.next_position
            if self.max_positions is not None and first + len(tokens) > self.max_positions:
                raise ConfigError(
                    f"a row would reach position {first + len(tokens)}, past the model's {self.max_positions}"
                )
            ids.extend(tokens)
            positions.extend(range(first, first + len(tokens)))
            rows.append(row)
            sizes.append(len(tokens))
            if segment.logits:
                keep.append(len(ids) - 1)
        return rows, sizes, ids, positions, keep


def _per_segment(out: torch.Tensor, wants: Sequence[bool]) -> list[torch.Tensor | None]:
    """Per segment, its float32 logits (``out``'s next row) or None where it asked for none."""
    logits = out[0].float()
    result: list[torch.Tensor | None] = []
    picked = 0
    for wanted in wants:
        if wanted:
            result.append(logits[picked])
            picked += 1
        else:
            result.append(None)
    return result
