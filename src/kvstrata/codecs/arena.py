"""A sequence's encoded blocks held as resident pages, one after the other in one byte arena.

A running request's cache keeps the blocks it attends to encoded (an interactive agent's int8s
blocks, a background agent's KIVI ones) in a :class:`PageArena`; its exact tokens (the sinks'
block when it is exact, the recent window, the tail and every token the request computes) stay
in the cache's own buffers. The store restores encoded blocks into an arena by copying their
pages (:mod:`kvstrata.codecs.pages`): nothing is decoded on the way, and the decode-attention
kernel reads them in place through :attr:`PageArena.table`. Code that needs a layer's keys and
values as tensors (a prefill's sdpa) gets them one layer at a time from
:meth:`PageArena.dequantize_layer`, into buffers the caller reuses for the next layer.

Blocks are kept in the order of their first token; their tokens come first in attention's order
(table order), then the cache's exact tokens: attention does not depend on the keys' order, and a
token's position is inside its key (rotated in), so only bookkeeping (which token a slot is, for
importance) needs :meth:`PageArena.logical_positions`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import numpy as np
import torch

from kvstrata.codecs import _pages_native
from kvstrata.codecs.pages import TABLE_COLUMNS, PageSpec, dequantize
from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout

_ALIGN = 64  # each block's pages start on a cache line


class PageArena:
    def __init__(self, layout: KVLayout, capacity_bytes: int = 0, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.buffer = torch.empty(max(capacity_bytes, 0), dtype=torch.uint8, device=self.device)
        self.used = 0
        self.specs: list[PageSpec] = []
        self.starts: list[int] = []
        """The sequence position of each block's first token, increasing."""
        self.offsets: list[int] = []
        self.tokens = 0
        self._table: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes the blocks' pages take (what the arena holds, alignment aside)."""
        return sum(spec.block_nbytes(self.layout) for spec in self.specs)

    def add(self, start: int, spec: PageSpec, pages: np.ndarray | torch.Tensor) -> None:
        """Copy one block's pages (uint8, ``spec.block_nbytes`` bytes) in, its first token at
        sequence position ``start``."""
        nbytes = pages.size if isinstance(pages, np.ndarray) else pages.numel()
        if nbytes != spec.block_nbytes(self.layout):
            raise ConfigError(
                f"a block's pages are {nbytes} bytes, its spec says {spec.block_nbytes(self.layout)}"
            )
        room = self.reserve(start, spec)
        if isinstance(pages, np.ndarray) and room.device.type == "cpu":
            room.numpy()[:] = pages.reshape(-1)  # no tensor of a read-only record's bytes
        elif isinstance(pages, np.ndarray):
            room.copy_(torch.from_numpy(pages.reshape(-1).copy()))
        else:
            room.copy_(pages.reshape(-1))

    def reserve(self, start: int, spec: PageSpec) -> torch.Tensor:
        """Room for one block's pages (a uint8 view for the caller to fill), its first token at
        sequence position ``start``, which no other block of the arena may cover."""
        if spec.head_dim != self.layout.head_dim:
            raise ConfigError(f"pages of head_dim {spec.head_dim} in an arena of {self.layout.head_dim}")
        index = bisect.bisect_left(self.starts, start)
        previous_end = self.starts[index - 1] + self.specs[index - 1].tokens if index else 0
        if previous_end > start or (index < len(self.starts) and self.starts[index] < start + spec.tokens):
            raise ConfigError(f"a block at position {start} overlaps another block of the arena")
        nbytes = spec.block_nbytes(self.layout)
        offset = -(-self.used // _ALIGN) * _ALIGN
        self._grow(offset + nbytes)
        self.used = offset + nbytes
        self.specs.insert(index, spec)
        self.starts.insert(index, start)
        self.offsets.insert(index, offset)
        self.tokens += spec.tokens
        self._table = None
        return self.buffer[offset : offset + nbytes]

    def _grow(self, needed: int) -> None:
        if needed <= self.buffer.numel():
            return
        grown = torch.empty(max(needed, 2 * self.buffer.numel()), dtype=torch.uint8, device=self.device)
        grown[: self.used].copy_(self.buffer[: self.used])
        self.buffer = grown

    @property
    def table(self) -> torch.Tensor:
        """int64 ``(blocks, 4)``: codec id, byte offset, tokens, group (the kernel's page table)."""
        if self._table is None:
            rows = [spec.table_row(offset) for spec, offset in zip(self.specs, self.offsets, strict=True)]
            self._table = torch.tensor(rows, dtype=torch.long).view(-1, TABLE_COLUMNS)
        return self._table

    def block_pages(self, index: int) -> torch.Tensor:
        """Block ``index``'s pages, uint8 ``(layers, heads, spec.nbytes)`` (a view)."""
        spec, offset = self.specs[index], self.offsets[index]
        pages = self.buffer[offset : offset + spec.block_nbytes(self.layout)]
        return pages.view(self.layout.num_layers, self.layout.num_kv_heads, spec.nbytes)

    def truncate(self, tokens: int) -> bool:
        """Keep only what the sequence's first ``tokens`` need: blocks starting at or after it
        go. False (nothing changed) when a block holds tokens on both sides of the cut."""
        if any(
            start < tokens < start + spec.tokens for start, spec in zip(self.starts, self.specs, strict=True)
        ):
            return False
        keep = [i for i, start in enumerate(self.starts) if start < tokens]
        self.specs = [self.specs[i] for i in keep]
        self.starts = [self.starts[i] for i in keep]
        self.offsets = [self.offsets[i] for i in keep]
        self.tokens = sum(spec.tokens for spec in self.specs)
        self._table = None
        return True

    def covered(self) -> Iterator[tuple[int, int]]:
        """(first position, tokens) of each block, in order."""
        return zip(self.starts, (spec.tokens for spec in self.specs), strict=True)

    def logical_positions(self, exact_tokens: int) -> torch.Tensor:
        """The sequence position of each slot in attention's order: the arena's tokens, then
        ``exact_tokens`` exact ones, which fill the positions no block covers, in order."""
        total = self.tokens + exact_tokens
        covered = torch.zeros(total, dtype=torch.bool)
        slots = []
        for start, tokens in self.covered():
            if start + tokens > total:
                raise ConfigError(f"a block ends at position {start + tokens}, past the sequence's {total}")
            covered[start : start + tokens] = True
            slots.append(torch.arange(start, start + tokens))
        return torch.cat([*slots, torch.nonzero(~covered).view(-1)])

    def dequantize_layer(self, layer: int, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Layer ``layer``'s keys and values of every block, in table order, into the first
        ``self.tokens`` tokens of ``out_k`` / ``out_v`` (float32 ``(heads, >= tokens, head_dim)``)."""
        if not self.specs:
            return
        buffer = self.buffer
        if _pages_native.dequantize_layer(buffer, self.table, layer, self.layout.num_kv_heads, out_k, out_v):
            return
        t0 = 0
        for index, spec in enumerate(self.specs):
            pages = self.block_pages(index)[layer : layer + 1]
            kv = dequantize(pages, spec)  # (2, 1, H, T, D)
            out_k[:, t0 : t0 + spec.tokens].copy_(kv[0, 0])
            out_v[:, t0 : t0 + spec.tokens].copy_(kv[1, 0])
            t0 += spec.tokens
