"""vLLM's fp8 KV caches (``--kv-cache-dtype fp8``, ``fp8_e5m2``) through the connector: blocks are
stored as the cache holds them (one byte an element, no round trip through another dtype) and a
hit gives the tokens the same fp8 engine computes without kvstrata.

One process (vLLM's offline ``LLM``), a bf16 model: vLLM's CPU backend runs fp8 caches only with
AVX-512 or AMX and a head size divisible by 32 (the tiny model's is 64).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import BLOCK, LAYOUT_ARGS, Models, Prompts, kvstrata_phase, plain_phase, request, run_job

pytestmark = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU backend runs fp8 KV caches only on x86 with AVX-512 or AMX",
)
FORMATS = {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def fp8(phase: dict, kv_cache_dtype: str) -> dict:
    return {**phase, "dtype": "bfloat16", "kv_cache_dtype": kv_cache_dtype}


@pytest.fixture(scope="module")
def fp8_run(work_dir: Path, models: Models, prompts: Prompts) -> list[dict]:
    p1, p2 = request(prompts.p1), request(prompts.p2)
    root = work_dir / "fp8-root"
    phases = []
    for kv_cache_dtype in FORMATS:
        phases += [
            fp8(plain_phase(models.a, [[p2]]), kv_cache_dtype),
            fp8(kvstrata_phase(models.a, root, [[p1], [p2]]), kv_cache_dtype),
            fp8(kvstrata_phase(models.a, root, [[p2]]), kv_cache_dtype),  # a new engine: from disk
        ]
    return run_job(work_dir, "fp8", phases)


def lookup(phase: dict, index: int) -> dict:
    return phase["events"]["lookups"][index]


@pytest.mark.parametrize("which", range(len(FORMATS)), ids=list(FORMATS))
def test_an_fp8_cache_hits_and_gives_the_fp8_engines_tokens(fp8_run, prompts: Prompts, which: int) -> None:
    base, conn, again = fp8_run[3 * which : 3 * which + 3]
    hit = prompts.prefix_len // BLOCK * BLOCK
    assert lookup(conn, 0)["external_tokens"] == 0  # the other fp8 format's blocks are not this one's
    assert lookup(conn, 1)["external_tokens"] == hit
    assert conn["rounds"][1][0]["num_cached_tokens"] == hit
    assert conn["rounds"][1][0]["tokens"] == base["rounds"][0][0]["tokens"]
    assert conn["events"]["page_format"] == "probed"  # placement and fp8 format learned from the backend
    assert conn["events"]["load_errors"] == 0
    assert lookup(again, 0)["tokens_by_source"] == {"disk": hit}
    assert again["rounds"][0][0]["tokens"] == base["rounds"][0][0]["tokens"]


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_stored_fp8_blocks_are_the_models_keys_and_values_one_byte_each(
    fp8_run, work_dir: Path, models: Models, prompts: Prompts, kv_cache_dtype: str
) -> None:
    """The first block of p1 as stored: the fp8 layout (one byte an element) and the K and V
    transformers computes for those tokens, as that fp8 format holds them."""
    from transformers import AutoModelForCausalLM

    from kvstrata.config import StoreConfig
    from kvstrata.keys import chain_keys, root_key
    from kvstrata.layout import KVLayout
    from kvstrata.store import KVStore
    from kvstrata.store.roots import store_for_layout

    from conftest import fingerprint

    layout = KVLayout(**{**LAYOUT_ARGS, "dtype": FORMATS[kv_cache_dtype]})  # type: ignore[arg-type]
    assert layout.bytes_per_block == KVLayout(**LAYOUT_ARGS).bytes_per_block // 4  # fp32's quarter
    model = AutoModelForCausalLM.from_pretrained(models.a, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        cache = model(torch.tensor([prompts.p1[:BLOCK]]), use_cache=True).past_key_values
    expected = torch.stack(
        [torch.stack([getattr(cache.layers[i], kind)[0] for i in range(2)]) for kind in ("keys", "values")]
    ).float()
    key = chain_keys(root_key(fingerprint(models.a), layout, "default"), prompts.p1, BLOCK)[0]
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)
    with KVStore(store_for_layout(work_dir / "fp8-root", layout), read_only=True, config=config) as store:
        assert store.layout == layout
        block = store.blocks.get(key)  # type: ignore[arg-type]
        assert block is not None
        stored = block.decoded(layout)
    assert stored.dtype == layout.torch_dtype
    # the same values up to the format's rounding: vLLM's bf16 kernels differ a little from eager
    # attention, and its CPU kernel rounds to fp8 mostly toward zero (about half the bytes differ from
    # torch's round-to-nearest of the same values), so this is closeness, not byte equality; a block
    # in the wrong place or read as the other fp8 format is off by the values' own size
    step = 2.0 ** -(3 if kv_cache_dtype == "fp8" else 2)
    torch.testing.assert_close(stored.float(), expected, rtol=2 * step, atol=0.6 * step)
    error = (stored.float() - expected).abs().mean() / expected.abs().mean()
    assert error < step / 2, f"stored KV is {error:.1%} off the model's on average"
