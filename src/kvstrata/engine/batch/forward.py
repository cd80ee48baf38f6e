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

How a step reaches the rows: the model gets a small :class:`Cache` whose ``update`` appends each
row's slice of the packed new keys and values to that row's layer, and the attention function
receives the step (the rows and their slices of the packed sequence) as a keyword argument
(transformers passes unknown forward kwargs down to the attention function). The causal mask
is built per row (bottom-right aligned: a query sees its row's history and the row's earlier
new tokens); the model builds no mask of its own for an attention implementation it does not
know. Per row, attention is the model's own implementation (``eager`` or ``sdpa``; with sdpa a
decode row groups its query heads by KV head, one kernel call), so a row's logits match the
same request run alone within float rounding (the tests check 1e-4 and equal greedy tokens).
With sdpa on a CPU, once :mod:`.decode_kernel`'s native kernel is built, the decode rows of a
layer (one query each, no attention tracking) go to it in one call instead.

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
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvstrata.engine.batch import decode_kernel
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.integrations.transformers.cache import KVStrataCache, layer_devices

ATTENTION_NAME = "kvstrata_batched"
_STEP_KWARG = "kvstrata_step"
_BASE_IMPLEMENTATIONS = ("eager", "sdpa")


class StepInterrupted(KVStrataError):
    """A step was given up before its end (its ``interrupt`` asked for it): every row is as it
    was before the step, and nothing of it counts."""


class BatchRow:
    """One sequence of the batch: its KV cache (all of its history) and the positions it uses.

    ``position_offset``: how far the row's positions lie past its cache slots (a lossy memory
    mode keeps the original positions of a pruned prefix; its new tokens continue from there).
    ``track_attention``: accumulate, per cache slot, the attention probability mass the slot
    received (summed over layers, heads and queries), for importance-aware eviction.
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
        """The tracked attention mass folded per block of ``block_tokens`` slots (float64)."""
        if self.attention_mass is None:
            raise ConfigError("this row does not track attention (track_attention=False)")
        mass = self.attention_mass
        blocks = (mass.numel() + block_tokens - 1) // block_tokens if num_blocks is None else num_blocks
        out = torch.zeros(blocks, dtype=torch.float64)
        n = min(mass.numel(), blocks * block_tokens)
        out.index_add_(0, torch.arange(n) // block_tokens, mass[:n])
        return out

    def _add_attention(self, weights: torch.Tensor) -> None:
        assert self.attention_mass is not None
        per_slot = weights.detach().to(torch.float64).sum(dim=(0, 1, 2)).cpu()
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


@dataclass(slots=True)
class _Step:
    """What the cache and the attention function of one forward pass share."""

    rows: list[BatchRow]
    sizes: list[int]
    """Each row's new tokens, in packed order: the packed tensors are split by them."""
    base_attention: str
    interrupt: Callable[[], bool] | None = None
    kernel: ModuleType | None = None
    """The native decode-attention kernel (:mod:`.decode_kernel`), for the rows in ``native``."""
    native: list[int] = field(default_factory=list)
    """The rows whose attention the kernel computes: one query, no attention tracking."""
    native_tokens: torch.Tensor | None = None
    """Their queries' places in the packed sequence (None: every row is native, in order)."""
    masks: list[torch.Tensor | None] = field(default_factory=list)
    views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


class _StepCache(Cache):
    """The cache the model sees during a batched step: ``update`` appends each row's slice of the
    packed new KV to the row's own layer and keeps views of the rows' whole KV for attention."""

    def __init__(self, step: _Step) -> None:
        super().__init__(layers=[])
        self.step = step

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = self.step.sizes
        keys, values = key_states.split(sizes, dim=2), value_states.split(sizes, dim=2)
        self.step.views[layer_idx] = [
            row.cache.layers[layer_idx].update(k, v)
            for row, k, v in zip(self.step.rows, keys, values, strict=True)
        ]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly


def _batched_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of the packed queries ``(1, heads, T, D)``, each row against its own KV."""
    step: _Step | None = kwargs.pop(_STEP_KWARG, None)
    if step is None:
        raise ConfigError(f"the {ATTENTION_NAME!r} attention runs only inside BatchedForward.forward")
    base = ALL_ATTENTION_FUNCTIONS.get_interface(step.base_attention, eager_attention_forward)
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    if step.interrupt is not None and step.interrupt():
        raise StepInterrupted(f"the step was given up at layer {layer_idx}")
    views = step.views[layer_idx]
    outputs: list[torch.Tensor | None] = [None] * len(step.rows)
    if step.kernel is not None and step.native:
        native = _native_attention(step, query, views, scaling)  # (rows, heads, D)
        if step.native_tokens is None:
            return native.unsqueeze(0), None
        for i, out in zip(step.native, native.unsqueeze(1).unsqueeze(1), strict=True):
            outputs[i] = out
    sdpa = step.base_attention == "sdpa"
    rows = zip(step.rows, query.split(step.sizes, dim=2), views, step.masks, strict=True)
    for i, (row, q, (keys, values), mask) in enumerate(rows):
        if outputs[i] is not None:
            continue
        if row.attention_mass is not None:  # eager, which returns the probabilities
            out, weights = eager_attention_forward(
                module, q, keys, values, mask, scaling=scaling, dropout=0.0
            )
            row._add_attention(weights)
        elif sdpa and q.shape[2] == 1:
            out = _sdpa_one_query(q, keys, values, scaling)
        else:
            out, _ = base(module, q, keys, values, mask, scaling=scaling, dropout=0.0)
        outputs[i] = out  # (1, n, heads, D)
    return torch.cat(outputs, dim=1), None  # type: ignore[arg-type]


def _native_attention(
    step: _Step, query: torch.Tensor, views: list[tuple[torch.Tensor, torch.Tensor]], scaling: float
) -> torch.Tensor:
    """The native rows' attention in one kernel call: ``(rows, heads, D)``."""
    assert step.kernel is not None
    packed = query[0].transpose(0, 1)  # (T, heads, D)
    if step.native_tokens is not None:
        packed = packed.index_select(0, step.native_tokens)
    keys = [views[i][0] for i in step.native]
    values = [views[i][1] for i in step.native]
    return decode_kernel.decode_attention(step.kernel, packed, keys, values, scaling)


def _sdpa_one_query(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """A decode row's attention, its query heads grouped by the key/value head they share (the
    group stands where the query tokens would): one kernel call without repeating the KV, and
    on CPU several times faster in bf16 than sdpa's ``enable_gqa`` path (measured in the
    batching bench). Returns ``(1, 1, heads, D)`` as the attention functions do."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[-1]
    grouped = query.reshape(1, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, scale=scaling)
    return out.reshape(1, 1, heads, dim)


def _row_mask(
    n_new: int, n_total: int, dtype: torch.dtype, device: torch.device, base: str
) -> torch.Tensor | None:
    """The causal mask of a row's ``n_new`` queries over its ``n_total`` keys (the last ``n_new``
    are the queries' own): query ``i`` sees keys ``0 .. n_total - n_new + i``. None when no key
    is hidden (one query), or for sdpa when its own ``is_causal`` is exact (no history)."""
    if n_new == 1 or (base == "sdpa" and n_new == n_total):
        return None
    first_hidden = torch.arange(n_new, device=device) + (n_total - n_new) + 1
    hidden = torch.arange(n_total, device=device)[None, :] >= first_hidden[:, None]
    if base == "sdpa":
        return (~hidden).view(1, 1, n_new, n_total)
    mask = torch.zeros(n_new, n_total, dtype=dtype, device=device)
    mask.masked_fill_(hidden, torch.finfo(dtype).min)
    return mask.view(1, 1, n_new, n_total)


class BatchedForward:
    """Runs steps of many rows through one causal LM (Llama family, eager or sdpa attention).

    Not thread-safe, and the model's attention implementation is switched for the duration of
    each step: run steps on the thread (or under the lock) that owns the model.
    """

    def __init__(self, model: torch.nn.Module, attention: str | None = None) -> None:
        """``attention``: the per-row attention, ``eager`` or ``sdpa`` (default: the model's own).
        Rows that track attention always use eager (it returns the probabilities)."""
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
        if self._native:
            decode_kernel.start()  # in the background; sdpa until it is loaded
        AttentionInterface.register(ATTENTION_NAME, _batched_attention)  # idempotent

    @torch.inference_mode()
    def forward(
        self, segments: Sequence[Segment], interrupt: Callable[[], bool] | None = None
    ) -> list[torch.Tensor | None]:
        """Run one step; returns, per segment, the float32 logits after its last token (None for
        a segment that asked for none). On an error every row is left as it was before the step.

        ``interrupt`` is asked before each layer's attention whether to give the step up (raising
        :class:`StepInterrupted`): a realtime request that became ready while a long step of
        other rows runs then waits for one layer, not for the rest of the step. What was computed
        of the step is thrown away: at most one step per realtime arrival."""
        rows, sizes, ids, positions, keep = self._pack(segments)
        if not rows:
            return []
        step = _Step(rows, sizes, self.base_attention, interrupt)
        if self._native:
            self._plan_native(step)
        dtype = self.model.dtype
        for row, n_new in zip(rows, sizes, strict=True):
            mask = _row_mask(n_new, row.length + n_new, dtype, self._input_device, self.base_attention)
            step.masks.append(mask)
        lengths = [row.length for row in rows]
        device = self._input_device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)
        logits_to_keep = torch.tensor(keep or [len(ids) - 1], dtype=torch.long, device=device)
        previous = self.model.config._attn_implementation
        try:
            self.model.set_attn_implementation(ATTENTION_NAME)
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                cache=_StepCache(step),
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{_STEP_KWARG: step},
            )
        except BaseException:
            for row, length in zip(rows, lengths, strict=True):
                _truncate(row, length)
            raise
        finally:
            self.model.set_attn_implementation(previous)
        logits = out.logits[0].float()
        result: list[torch.Tensor | None] = []
        picked = 0
        for segment in segments:
            if segment.logits:
                result.append(logits[picked])
                picked += 1
            else:
                result.append(None)
        return result

    def _plan_native(self, step: _Step) -> None:
        """Give the kernel (once it is loaded) the step's decode rows that track no attention."""
        step.kernel = decode_kernel.loaded()
        if step.kernel is None:
            return
        tokens: list[int] = []
        offset = 0
        for i, (row, n_new) in enumerate(zip(step.rows, step.sizes, strict=True)):
            if n_new == 1 and row.attention_mass is None:
                step.native.append(i)
                tokens.append(offset)
            offset += n_new
        if len(step.native) != offset:  # some rows prefill or track attention
            step.native_tokens = torch.tensor(tokens, dtype=torch.long, device=self._input_device)

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


def _truncate(row: BatchRow, length: int) -> None:
    """Undo a failed step's appends: every layer back to ``length`` tokens."""
    for layer in row.cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)
