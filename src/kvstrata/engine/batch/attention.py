"""The per-row attention of a batched step: each row's queries against its own history.

The model gets a small :class:`StepCache` whose ``update`` appends each row's slice of the packed
new keys and values to that row's layer (in place) and keeps views of the rows' exact tokens; the
registered attention function (:func:`batched_attention`) receives the step as a keyword
argument (transformers passes unknown forward kwargs down to it). Per row it is the model's own
attention (``eager`` or ``sdpa``; with sdpa a decode row groups its query heads by KV head, one
kernel call), so a row's logits match the same request run alone within float rounding. With
sdpa on a CPU, once :mod:`.decode_kernel`'s native kernel is built, the decode rows of a layer
(one query each) go to it in one call instead: their exact tokens and the blocks they hold
encoded (:class:`~kvstrata.codecs.arena.PageArena`), read where they lie, with each token's
attention mass added up for the rows that track it. A row that holds encoded blocks and does
not go to the kernel (a prefill, a machine without it) attends over its layer's keys and values
dequantized into a scratch buffer, one layer at a time
(:class:`~kvstrata.integrations.transformers.paged.PagedLayer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvstrata.engine.batch import decode_kernel
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.integrations.transformers.cache import KVStrataCache
from kvstrata.integrations.transformers.layer import append_rows
from kvstrata.integrations.transformers.paged import PagedLayer

ATTENTION_NAME = "kvstrata_batched"
STEP_KWARG = "kvstrata_step"
_NO_PAGES = torch.empty(0, dtype=torch.uint8)
_NO_TABLE = torch.empty((0, 4), dtype=torch.long)


class AttendingRow(Protocol):
    """What attention uses of a row (:class:`~kvstrata.engine.batch.forward.BatchRow`)."""

    cache: KVStrataCache
    attention_mass: torch.Tensor | None
    """Per slot, the probability mass received so far; None when the row tracks none."""

    def add_attention(self, weights: torch.Tensor) -> None: ...

    def kernel_mass_buffer(self) -> torch.Tensor: ...


class StepInterrupted(KVStrataError):
    """A step was given up before its end (its ``interrupt`` asked for it): every row is as it
    was before the step, and nothing of it counts."""


@dataclass(slots=True)
class Step:
    """What the cache and the attention function of one forward pass share."""

    rows: list[AttendingRow]
    sizes: list[int]
    """Each row's new tokens, in packed order: the packed tensors are split by them."""
    base_attention: str
    num_layers: int
    interrupt: Callable[[], bool] | None = None
    kernel: ModuleType | None = None
    """The native decode-attention kernel (:mod:`.decode_kernel`), for the rows in ``native``."""
    native: list[int] = field(default_factory=list)
    """The rows whose attention the kernel computes: one query each."""
    native_tokens: torch.Tensor | None = None
    """Their queries' places in the packed sequence (None: every row is native, in order)."""
    arenas: list[torch.Tensor] | None = None
    """Per native row, its encoded blocks' arena (empty for a row with none); None: no row has any."""
    tables: list[torch.Tensor] = field(default_factory=list)
    masses: list[torch.Tensor] = field(default_factory=list)
    """Per native row, the buffer its attention mass is added to (empty: not tracked)."""
    masks: list[torch.Tensor | None] = field(default_factory=list)
    views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    grouped: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per prefilling row, its mask repeated per query head group (:meth:`grouped_mask`)."""

    def grouped_mask(self, row: int, group: int) -> torch.Tensor:
        """Row ``row``'s mask repeated for the ``group`` query heads of a key/value head
        (:func:`_sdpa_grouped`): made at the step's first layer, used by all."""
        mask = self.grouped.get(row)
        if mask is None:
            mask = self.masks[row]
            assert mask is not None
            mask = mask.repeat(1, 1, group, 1) if group > 1 else mask
            self.grouped[row] = mask
        return mask

    def plan_native(self, kernel: ModuleType, device: torch.device) -> None:
        """Give ``kernel`` the step's decode rows (their pages and attention mass with them)."""
        self.kernel = kernel
        tokens: list[int] = []
        offset = 0
        for i, n_new in enumerate(self.sizes):
            if n_new == 1:
                self.native.append(i)
                tokens.append(offset)
            offset += n_new
        if len(self.native) != offset:  # some rows prefill
            self.native_tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        native_rows = [self.rows[i] for i in self.native]
        self.masses = [row.kernel_mass_buffer() for row in native_rows]
        if all(mass.numel() == 0 for mass in self.masses):
            self.masses = []
        pages = [row.cache.pages for row in native_rows]
        if any(p is not None and len(p) for p in pages):
            self.arenas = [p.buffer if p is not None and len(p) else _NO_PAGES for p in pages]
            self.tables = [p.table if p is not None and len(p) else _NO_TABLE for p in pages]


class StepCache(Cache):
    """The cache the model sees during a batched step: ``update`` appends each row's slice of the
    packed new KV to the row's own layer and keeps views of the rows' exact tokens for attention."""

    def __init__(self, step: Step, native: ModuleType | None = None) -> None:
        super().__init__(layers=[])
        self.step = step
        self.native = native
        """The native module (:mod:`.decode_kernel`): all rows of a layer appended in one call."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = self.step.sizes
        layers = [row.cache.layers[layer_idx] for row in self.step.rows]
        if self.native is not None and append_rows(self.native, layers, key_states, value_states, sizes):
            self.step.views[layer_idx] = [(layer.keys, layer.values) for layer in layers]
            return key_states, value_states
        keys, values = key_states.split(sizes, dim=2), value_states.split(sizes, dim=2)
        self.step.views[layer_idx] = [
            layer.append(k, v)  # type: ignore[attr-defined]
            for layer, k, v in zip(layers, keys, values, strict=True)
        ]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly


def batched_attention(
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
    step: Step | None = kwargs.pop(STEP_KWARG, None)
    if step is None:
        raise ConfigError(f"the {ATTENTION_NAME!r} attention runs only inside BatchedForward.forward")
    base = ALL_ATTENTION_FUNCTIONS.get_interface(step.base_attention, eager_attention_forward)
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    if step.interrupt is not None and step.interrupt():
        raise StepInterrupted(f"the step was given up at layer {layer_idx}")
    views = step.views[layer_idx]
    outputs: list[torch.Tensor | None] = [None] * len(step.rows)
    if step.kernel is not None and step.native:
        native = _native_attention(step, query, views, scaling, layer_idx)  # (rows, heads, D)
        if step.native_tokens is None:
            return native.unsqueeze(0), None
        for i, out in zip(step.native, native.unsqueeze(1).unsqueeze(1), strict=True):
            outputs[i] = out
    sdpa = step.base_attention == "sdpa"
    rows = zip(step.rows, query.split(step.sizes, dim=2), views, step.masks, strict=True)
    for i, (row, q, (keys, values), mask) in enumerate(rows):
        if outputs[i] is not None:
            continue
        layer = row.cache.layers[layer_idx]
        if isinstance(layer, PagedLayer) and len(layer.pages):
            keys, values = layer.dense()  # the encoded blocks dequantized, then the exact tokens
        if row.attention_mass is not None:  # eager, which returns the probabilities
            out, weights = eager_attention_forward(
                module, q, keys, values, mask, scaling=scaling, dropout=0.0
            )
            row.add_attention(weights)
        elif sdpa and q.shape[2] == 1:
            out = _sdpa_one_query(q, keys, values, scaling)
        elif sdpa and mask is not None:
            group = q.shape[1] // keys.shape[1]
            out = _sdpa_grouped(q, keys, values, step.grouped_mask(i, group), scaling)
        else:
            out, _ = base(module, q, keys, values, mask, scaling=scaling, dropout=0.0)
        outputs[i] = out  # (1, n, heads, D)
    return torch.cat(outputs, dim=1), None  # type: ignore[arg-type]


def _native_attention(
    step: Step,
    query: torch.Tensor,
    views: list[tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
    layer_idx: int,
) -> torch.Tensor:
    """The native rows' attention in one kernel call: ``(rows, heads, D)``."""
    assert step.kernel is not None
    packed = query[0].transpose(0, 1)  # (T, heads, D)
    if step.native_tokens is not None:
        packed = packed.index_select(0, step.native_tokens)
    keys = [views[i][0] for i in step.native]
    values = [views[i][1] for i in step.native]
    pages = None
    if step.arenas is not None:
        pages = decode_kernel.PagedRows(step.arenas, step.tables, layer_idx, step.num_layers)
    return decode_kernel.decode_attention(
        step.kernel, packed, keys, values, scaling, pages, step.masses or None
    )


def _sdpa_one_query(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """A decode row's attention, its query heads grouped by the key/value head they share (the
    group stands where the query tokens would): one kernel call without repeating the KV, and
    on CPU several times faster in bf16 than sdpa's ``enable_gqa`` path (measured in the
    batching bench). Returns ``(1, 1, heads, D)`` as the attention functions do."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[-1]
    grouped = query.reshape(1, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, scale=scaling)
    return out.reshape(1, 1, heads, dim)


def _sdpa_grouped(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """A row's queries ``(1, heads, n, D)`` against its keys, without repeating the key/value
    heads: the query heads that share a key/value head stand one after another as more query
    tokens, one sdpa call over the key/value heads; ``mask`` is the row's mask repeated for them
    (:meth:`Step.grouped_mask`). transformers' sdpa attention repeats each key/value head for its
    queries whenever a mask is given (a copy of the row's whole history per layer). Returns
    ``(1, n, heads, D)`` as the attention functions do."""
    _, heads, n, dim = query.shape
    grouped = query.reshape(1, keys.shape[1], -1, dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
    return out.view(1, heads, n, dim).transpose(1, 2)


def row_mask(
    n_new: int, n_total: int, dtype: torch.dtype, device: torch.device, base: str
) -> torch.Tensor | None:
    """The causal mask of a row's ``n_new`` queries over its ``n_total`` keys (the last ``n_new``
    are the queries' own): query ``i`` sees keys ``0 .. n_total - n_new + i``. None when no key
    is hidden (one query), or for sdpa when its own ``is_causal`` is exact (no history)."""
    if n_new == 1 or (base == "sdpa" and n_new == n_total):
        return None
    first_hidden = torch.arange(n_new, device=device) + (n_total - n_new) + 1
    hidden = torch.arange(n_total, device=device)[None, :] >= first_hidden[:, None]
    mask = torch.zeros(n_new, n_total, dtype=dtype, device=device)
    mask.masked_fill_(hidden, -torch.inf if base == "sdpa" else torch.finfo(dtype).min)
    return mask.view(1, 1, n_new, n_total)
