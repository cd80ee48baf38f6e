"""The decode kernel over encoded blocks read in place (resident pages): against dequantize-then-
sdpa, each row alone, the attention mass it adds up, and its refusals of page tables that do not
fit the arena or the head."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kvstrata.codecs import BlockContext, Int8SymCodec, get_codec, pages
from kvstrata.codecs.arena import PageArena
from kvstrata.engine.batch import decode_kernel
from kvstrata.layout import KVLayout

F = torch.nn.functional
LAYERS, HEADS, DIM, GROUP = 3, 2, 64, 3


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = decode_kernel.load()
    if module is None:
        pytest.skip(f"the native kernel is not available here: {decode_kernel.status()}")
    return module


def row(
    codecs: list[str], exact: int, dtype: torch.dtype, seed: int
) -> tuple[PageArena, torch.Tensor, torch.Tensor]:
    """An arena of blocks of ``codecs`` (token counts drawn), ``exact`` exact tokens, and the
    reference: every token's float32 keys and values in attention's order, ``(2, L, H, n, D)``."""
    lay = KVLayout(LAYERS, HEADS, DIM, "float32", 64)
    gen = torch.Generator().manual_seed(seed)
    arena = PageArena(lay)
    reference = []
    start = 64
    for name in codecs:
        tokens = int(torch.randint(1, 65, (1,), generator=gen))
        kv = torch.randn(lay.block_shape(tokens), generator=gen)
        kv[0, ..., 5] += 8.0  # an outlier key channel, as real keys have
        # int8s-32: two scale groups a token (the kernel's path for a group narrower than the head)
        codec = Int8SymCodec(group_size=32) if name == "int8s-32" else get_codec(name)
        block = codec.encode(kv, BlockContext(start))
        spec = pages.page_spec(block, lay)
        assert spec is not None
        arena.add(start, spec, pages.to_pages(block, spec, lay))
        reference.append(pages.dequantize(arena.block_pages(len(arena) - 1), spec))
        start += tokens
    exact_kv = torch.randn(2, LAYERS, HEADS, exact, DIM, generator=gen).to(dtype)
    reference.append(exact_kv.float())
    return arena, exact_kv, torch.cat(reference, dim=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "codecs",
    [
        [],
        ["int8s"],
        ["int8s-32"],
        ["kivi4"],
        ["kivi2"],
        ["int8s", "kivi4", "kivi2", "int8s-32", "int8s", "kivi4"],
        ["kvmix"],
        ["kvmix", "int8s", "kvmix", "kivi4", "kvmix"],
    ],
)
def test_pages_read_in_place_match_dequantize_then_sdpa(
    kernel: ModuleType, dtype: torch.dtype, codecs: list[str]
) -> None:
    rows = [row(codecs, 3 + r, dtype, seed=10 * r + len(codecs)) for r in range(3)]
    query = torch.randn(3, HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    for layer in range(LAYERS):
        masses = [torch.zeros(HEADS, 400) for _ in rows]
        paged = decode_kernel.PagedRows(
            [r[0].buffer for r in rows], [r[0].table for r in rows], layer, LAYERS
        )
        keys = [r[1][0, layer].unsqueeze(0) for r in rows]
        values = [r[1][1, layer].unsqueeze(0) for r in rows]
        out = decode_kernel.decode_attention(kernel, query, keys, values, 0.125, paged, masses)
        for i, (_, _, reference) in enumerate(rows):
            grouped = query[i].reshape(1, HEADS, GROUP, DIM).float()
            k, v = reference[0, layer].unsqueeze(0), reference[1, layer].unsqueeze(0)
            want = F.scaled_dot_product_attention(grouped, k, v, scale=0.125).reshape(HEADS * GROUP, DIM)
            tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
            if "kvmix" in codecs and dtype == torch.float32:
                tolerance = 1e-5  # the values' rotation turned back by a transform, not a matmul
            torch.testing.assert_close(out[i].float(), want.to(dtype).float(), atol=tolerance, rtol=tolerance)
            probabilities = torch.softmax(grouped @ k.transpose(-1, -2) * 0.125, dim=-1).sum(dim=2)[0]
            tokens = probabilities.shape[-1]
            torch.testing.assert_close(masses[i][:, :tokens], probabilities, atol=1e-6, rtol=1e-5)
            assert bool((masses[i][:, tokens:] == 0).all())
            alone = decode_kernel.decode_attention(
                kernel,
                query[i : i + 1],
                keys[i : i + 1],
                values[i : i + 1],
                0.125,
                decode_kernel.PagedRows([rows[i][0].buffer], [rows[i][0].table], layer, LAYERS),
            )
            assert torch.equal(alone[0], out[i])  # a row's result does not depend on its neighbours


def test_a_row_of_pages_only_and_rows_without_pages_beside_it(kernel: ModuleType) -> None:
    paged_row = row(["int8s", "kivi4"], 0, torch.float32, seed=3)
    plain = row([], 9, torch.float32, seed=4)
    query = torch.randn(2, HEADS * GROUP, DIM)
    arenas = [paged_row[0].buffer, torch.empty(0, dtype=torch.uint8)]
    tables = [paged_row[0].table, torch.empty((0, 4), dtype=torch.long)]
    keys = [paged_row[1][0, 1].unsqueeze(0), plain[1][0, 1].unsqueeze(0)]
    values = [paged_row[1][1, 1].unsqueeze(0), plain[1][1, 1].unsqueeze(0)]
    out = decode_kernel.decode_attention(
        kernel, query, keys, values, 0.125, decode_kernel.PagedRows(arenas, tables, 1, LAYERS)
    )
    for i, (_, _, reference) in enumerate([paged_row, plain]):
        grouped = query[i].reshape(1, HEADS, GROUP, DIM)
        want = F.scaled_dot_product_attention(
            grouped, reference[0, 1].unsqueeze(0), reference[1, 1].unsqueeze(0), scale=0.125
        )
        torch.testing.assert_close(out[i], want.reshape(HEADS * GROUP, DIM), atol=2e-6, rtol=2e-6)


def test_page_tables_that_do_not_fit_are_refused(kernel: ModuleType) -> None:
    arena, exact, _ = row(["int8s", "kivi4"], 2, torch.float32, seed=5)
    query = torch.randn(1, HEADS * GROUP, DIM)
    keys, values = [exact[0, 0].unsqueeze(0)], [exact[1, 0].unsqueeze(0)]

    def call(buffer: torch.Tensor, table: torch.Tensor, layer: int = 0) -> None:
        paged = decode_kernel.PagedRows([buffer], [table], layer, LAYERS)
        decode_kernel.decode_attention(kernel, query, keys, values, 0.125, paged)

    with pytest.raises(RuntimeError, match="outside its arena"):
        call(arena.buffer[: arena.used - 1], arena.table)
    shifted = arena.table.clone()
    shifted[1, 1] += 64
    with pytest.raises(RuntimeError, match="outside its arena"):
        call(arena.buffer[: arena.used], shifted)
    unknown = arena.table.clone()
    unknown[0, 0] = 4  # the asymmetric int8 codec: no page layout
    with pytest.raises(RuntimeError, match="does not read"):
        call(arena.buffer, unknown)
    odd_group = arena.table.clone()
    odd_group[1, 3] = 16  # a KIVI-4 value group narrower than the 32 channels a vector unpacks
    with pytest.raises(RuntimeError, match="does not read"):
        call(arena.buffer, odd_group)
    with pytest.raises(RuntimeError, match="layer out of range"):
        call(arena.buffer, arena.table, layer=LAYERS)
    with pytest.raises(RuntimeError, match="one arena and one page table per row"):
        decode_kernel.decode_attention(
            kernel,
            query,
            keys,
            values,
            0.125,
            decode_kernel.PagedRows([arena.buffer] * 2, [arena.table], 0, LAYERS),
        )
