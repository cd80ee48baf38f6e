"""The codec quality harness on the tiny random Llama: exact values where a codec is lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.cli.main import app
from kvstrata.errors import ConfigError
from kvstrata.eval import CodecQuality, eval_text, evaluate_codecs
from kvstrata.integrations.transformers.model import LoadedModel, save_tiny_llama, tiny_llama
from kvstrata.integrations.transformers.tiny_tokenizer import tiny_tokenizer

CONTEXT_TOKENS = 128
EVAL_TOKENS = 40  # crosses a block boundary at 192, so a block filled during the loop is compressed too
JSON_FIELDS = {
    "codec",
    "ratio",
    "ppl_delta_pct",
    "kl",
    "top1",
    "encode_gbps",
    "decode_gbps",
    "memcpy_gbps",
    "bit_exact",
}


def _tiny_loaded() -> LoadedModel:
    return LoadedModel(
        model=tiny_llama(0), tokenizer=tiny_tokenizer(), name="tiny", path=Path("."), fingerprint=b""
    )


@pytest.fixture(scope="module")
def rows() -> dict[str, CodecQuality]:
    loaded = _tiny_loaded()
    token_ids = loaded.tokenizer(eval_text(), add_special_tokens=False)["input_ids"]
    results = evaluate_codecs(
        loaded, token_ids, ["identity", "lossless", "int8", "naive_int4"], CONTEXT_TOKENS, EVAL_TOKENS
    )
    return {row.codec: row for row in results}


def test_rows_in_requested_order() -> None:
    loaded = _tiny_loaded()
    results = evaluate_codecs(loaded, list(range(3, 200)), ["int8", "identity"], 64, 4)
    assert [row.codec for row in results] == ["int8", "identity"]


def test_identity_changes_nothing(rows: dict[str, CodecQuality]) -> None:
    row = rows["identity"]
    assert row.ppl_delta_pct == 0.0
    assert row.kl == 0.0
    assert row.top1 == 1.0
    assert row.bit_exact is True
    assert row.ratio == pytest.approx(1.0, rel=1e-3)  # the record's few params bytes only
    assert row.ppl == row.ppl_reference


def test_lossless_is_bit_exact_and_smaller(rows: dict[str, CodecQuality]) -> None:
    row = rows["lossless"]
    assert row.bit_exact is True
    assert row.kl == 0.0
    assert row.top1 == 1.0
    assert row.ratio > 1.0


def test_int8_is_close_and_naive_int4_is_worse(rows: dict[str, CodecQuality]) -> None:
    int8, naive = rows["int8"], rows["naive_int4"]
    assert int8.bit_exact is False
    assert 0.0 < int8.kl < naive.kl
    assert naive.ratio > int8.ratio > 3.0
    assert int8.ratio_vs_fp16 == pytest.approx(int8.ratio / 2)


def test_throughputs_are_positive(rows: dict[str, CodecQuality]) -> None:
    for row in rows.values():
        assert row.encode_gbps > 0 and row.decode_gbps > 0 and row.memcpy_gbps > 0


def test_too_short_text_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="tokens"):
        evaluate_codecs(_tiny_loaded(), list(range(3, 100)), ["identity"], 64, 64)


def test_unknown_codec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown codec"):
        evaluate_codecs(_tiny_loaded(), list(range(3, 200)), ["nope"], 64, 4)


def test_cli_json_fields(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "codecs",
            "--model",
            str(model_dir),
            "--context-tokens",
            "64",
            "--eval-tokens",
            "4",
            "--codecs",
            "identity,int8",
            "--json",
        ],
        env={"KVSTRATA_MODEL_CACHE": str(tmp_path / "cache")},
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [row["codec"] for row in data] == ["identity", "int8"]
    for row in data:
        assert set(row) == JSON_FIELDS
    assert data[0]["bit_exact"] is True and data[0]["kl"] == 0.0
    assert data[1]["bit_exact"] is False


def test_cli_unknown_codec_fails(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    result = CliRunner().invoke(
        app,
        ["eval", "codecs", "--model", str(model_dir), "--codecs", "nope", "--json"],
        env={"KVSTRATA_MODEL_CACHE": str(tmp_path / "cache")},
    )
    assert result.exit_code == 1
    assert "unknown codec" in result.output


def test_cli_defaults_match_the_harness() -> None:
    from kvstrata.cli import eval_cmd
    from kvstrata.eval import codec_quality

    assert eval_cmd.DEFAULT_CONTEXT_TOKENS == codec_quality.DEFAULT_CONTEXT_TOKENS
    assert eval_cmd.DEFAULT_EVAL_TOKENS == codec_quality.DEFAULT_EVAL_TOKENS
