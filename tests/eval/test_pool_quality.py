"""The pool quality harness on the tiny random Llama (head_dim 64): a scheme that encodes nothing
changes nothing; encoded schemes hold their blocks as they say, at the sizes they promise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.cli.main import app
from kvstrata.codecs import CodecId
from kvstrata.codecs.pages import PageSpec
from kvstrata.errors import ConfigError
from kvstrata.eval import eval_text
from kvstrata.eval.pool_quality import PoolQuality, evaluate_pool
from kvstrata.integrations.transformers.model import LoadedModel, save_tiny_llama, tiny_llama
from kvstrata.integrations.transformers.tiny_tokenizer import tiny_tokenizer
from kvstrata.policy.grades import GradedCodecs

CONTEXT, EVAL = 256, 70  # 4 blocks, the last in the window; the run crosses a block boundary


@pytest.fixture(scope="module")
def rows() -> dict[str, PoolQuality]:
    model = tiny_llama(0, num_layers=2, hidden=256, heads=4, kv_heads=2)
    model.set_attn_implementation("sdpa")
    loaded = LoadedModel(
        model=model, tokenizer=tiny_tokenizer(), name="tiny", path=Path("."), fingerprint=b""
    )
    token_ids = loaded.tokenizer(eval_text(), add_special_tokens=False)["input_ids"]
    graded = {
        "none": GradedCodecs(None, None, None),
        "mixed": GradedCodecs("int8s", "kivi4", "kivi2", 0.3, 0.34),
    }
    results = evaluate_pool(
        loaded, token_ids, ["none", "int8s", "kivi4", "mixed"], CONTEXT, EVAL, graded=graded
    )
    return {row.scheme: row for row in results}


def test_a_scheme_that_encodes_nothing_changes_nothing(rows: dict[str, PoolQuality]) -> None:
    row = rows["none"]
    assert (row.ppl_delta_pct, row.kl, row.top1) == (0.0, 0.0, 1.0)
    assert row.blocks == {"exact": 6}


def test_encoded_schemes_hold_their_blocks_as_they_say(rows: dict[str, PoolQuality]) -> None:
    # 3 context blocks out of the window, then the window block once the run fills block 4
    assert rows["int8s"].blocks == {"int8s": 4, "exact": 2}
    assert rows["kivi4"].blocks == {"kivi4": 4, "exact": 2}
    assert rows["mixed"].blocks == {"int8s": 1, "kivi2": 1, "kivi4": 2, "exact": 2}
    for name in ("int8s", "kivi4", "mixed"):
        assert rows[name].kl > 0 and rows[name].top1 > 0.5
    assert rows["int8s"].kl < rows["kivi4"].kl


def test_sizes_count_the_pages_and_the_sinks(rows: dict[str, PoolQuality]) -> None:
    # per (layer, head): the first block's 60 tokens after the sinks (keys padded to 64) and three
    # full blocks of int8s pages, the 4 sink tokens exact in fp32; against fp16 (256 bytes a token)
    pages = PageSpec(CodecId.INT8S, 60, 64, 64).nbytes + 3 * PageSpec(CodecId.INT8S, 64, 64, 64).nbytes
    assert pages == (124 * 64 + 124 * 2) + 3 * 8448
    want = 4 * 64 * 256 / (pages + 4 * 512)
    assert rows["int8s"].ratio_vs_fp16 == pytest.approx(want)
    assert rows["int8s"].ratio_vs_model == pytest.approx(2 * want)
    assert 1.0 < rows["int8s"].ratio_vs_fp16 < rows["kivi4"].ratio_vs_fp16


def test_unknown_schemes_are_refused() -> None:
    loaded = LoadedModel(
        model=tiny_llama(0), tokenizer=tiny_tokenizer(), name="tiny", path=Path("."), fingerprint=b""
    )
    with pytest.raises(ConfigError, match="unknown pool schemes"):
        evaluate_pool(loaded, list(range(3, 400)), ["no-such"], 128, 4)


def test_cli_json_and_an_unknown_scheme(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny", hidden=256, heads=4, kv_heads=2)
    env = {"KVSTRATA_MODEL_CACHE": str(tmp_path / "cache")}
    args = ["eval", "pool", "--model", str(model_dir), "--context-tokens", "128", "--eval-tokens", "4"]
    result = CliRunner().invoke(app, [*args, "--schemes", "int8s", "--json"], env=env)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["scheme"] == "int8s" and row["blocks"] == {"int8s": 1, "exact": 2}
    result = CliRunner().invoke(app, [*args, "--schemes", "nope"], env=env)
    assert result.exit_code == 1 and "unknown pool schemes" in result.output
