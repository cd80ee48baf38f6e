"""The connector's configuration and page-format code, without an engine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvstrata import GcConfig, KVStore
from kvstrata.config import StoreConfig, parse_size
from kvstrata.errors import ConfigError
from kvstrata.integrations.vllm.config import ConnectorConfig
from kvstrata.integrations.vllm.layout import PageFormat
from kvstrata.integrations.vllm.ranks import rank_key
from kvstrata.layout import KVLayout
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.priority import Priority


def test_sizes() -> None:
    assert parse_size(4096, "x") == 4096
    assert parse_size("512MiB", "x") == 512 << 20
    assert parse_size("2G", "x") == 2 << 30
    assert parse_size("1.5KiB", "x") == 1536
    assert parse_size("10MB", "x") == 10_000_000
    for bad in ("lots", "12 parsecs", True, -1.5):
        with pytest.raises(ConfigError):
            parse_size(bad, "x")


def test_extra_config_maps_onto_store_config(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra_config(
        {
            "store_dir": str(tmp_path / "s"),
            "l1_budget_bytes": "64MiB",
            "l2_budget_bytes": 1 << 30,
            "l3_budget_bytes": "10GiB",
            "l3_direct_reads": False,
            "l3_direct_writes": False,
            "write_policy": "write-back",
            "priority": "interactive",
            "namespace": "team-a",
            "remote_url": "redis://127.0.0.1:6379",
            "remote_ttl_s": 3600,
            "ladder": {"interactive": {"l2": "identity", "l3": "int8"}, "background": "kivi2"},
            "model_fingerprint": "ab" * 16,
            "save_decode_blocks": False,
        }
    )
    assert cfg.store_dir == tmp_path / "s"
    assert cfg.store.l1_budget_bytes == 64 << 20
    assert cfg.store.l3_budget_bytes == 10 << 30
    assert cfg.store.l3_direct_reads is False and StoreConfig().l3_direct_reads is True
    assert cfg.store.l3_direct_writes is False and StoreConfig().l3_direct_writes is True
    assert cfg.store.write_policy.value == "write-back"
    assert cfg.priority is Priority.INTERACTIVE
    assert cfg.namespace == "team-a"
    assert cfg.store.remote is not None and cfg.store.remote.ttl_s == 3600
    assert cfg.store.ladder.interactive == Rung("identity", "int8", "int8s")  # l1: the class default
    assert cfg.store.ladder.background == Rung("kivi2", "kivi2", "kivi4")
    assert cfg.model_fingerprint == bytes.fromhex("ab" * 16)
    assert cfg.save_decode_blocks is False


def test_namespace_quotas_reach_the_store_config(tmp_path: Path) -> None:
    from kvstrata.config import NamespaceQuota

    config = ConnectorConfig.from_extra_config(
        {"store_dir": str(tmp_path), "namespace_quotas": {"salt-a": {"l1_bytes": "1MiB", "l3_bytes": 4096}}}
    )
    assert config.store.namespace_quotas == {"salt-a": NamespaceQuota(l1_bytes=1 << 20, l3_bytes=4096)}
    with pytest.raises(ConfigError, match="unknown quota keys"):
        ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "namespace_quotas": {"a": {"l9": 1}}})
    with pytest.raises(ConfigError, match="namespace_quotas must be"):
        ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "namespace_quotas": ["a"]})


def test_the_durability_mode_reaches_the_store_config(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "durability": "strict"})
    assert config.store.durability == "strict"
    assert ConnectorConfig.from_extra_config({"store_dir": str(tmp_path)}).store.durability == "fast"
    with pytest.raises(ConfigError, match="durability must be one of"):
        ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "durability": "eventually"})


def test_the_cold_dir_reaches_the_store_and_gc_moves_blocks_there(tmp_path: Path) -> None:
    cold = tmp_path / "cold-disk"
    cold.mkdir()
    config = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path / "root"), "cold_dir": str(cold)})
    assert config.store.cold_dir == str(cold)
    assert ConnectorConfig.from_extra_config({"store_dir": str(tmp_path)}).store.cold_dir is None
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)
    with KVStore(config.store_path(layout), layout, model_fingerprint=b"m", config=config.store) as store:
        session = store.create_session("s")
        store.append(session, [1, 2, 3, 4], torch.ones(2, 2, 2, 4, 8))
        store.checkpoint(session)
        report = store.maintenance.collect_garbage(GcConfig(cold_after_s=3600), now=time.time() + 86400)
        assert report.blocks_moved_cold == 1
    assert list(cold.rglob("*.kvbin"))  # on the cold disk, not under the store
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for bad, says in ((tmp_path / "missing", "does not exist"), (not_a_dir, "is not a directory")):
        with pytest.raises(ConfigError, match=f"cold_dir .* {says}"):
            ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "cold_dir": str(bad)})


def test_defaults_are_exact_and_local(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path)})
    assert cfg.priority is Priority.REALTIME  # exact KV everywhere: a hit gives a recompute's tokens
    assert cfg.store.remote is None
    assert CodecLadder.parse("exact") == CodecLadder.exact()


def test_unknown_or_bad_settings_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown kvstrata connector settings: store_path"):
        ConnectorConfig.from_extra_config({"store_path": str(tmp_path)})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"priority": "urgent"})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"remote_url": "http://example"})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"ladder": {"realtime": "no-such-codec"}})


class _CpuStyleImpl:
    """Writes K and V the way vLLM 0.32's CPU backend does (as the probe found it): per head, K
    transposed (``[D, N]``: channel-major), then V (``[N, D]``)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        blocks, heads, tokens, content = kv_cache.shape
        dim = content // 2
        flat = kv_cache.view(blocks, heads, 2, tokens * dim)
        for i, slot in enumerate(slot_mapping.tolist()):
            b, t = divmod(slot, tokens)
            flat[b, :, 0].view(heads, dim, tokens)[:, :, t] = key[i]
            flat[b, :, 1].view(heads, tokens, dim)[:, t] = value[i]


class _Layer:
    impl = _CpuStyleImpl()


def test_probe_learns_the_backend_page_format() -> None:
    heads, tokens, dim = 2, 16, 8
    cache = torch.zeros(4, heads, tokens, 2 * dim, dtype=torch.bfloat16)
    fmt = PageFormat.probe(_Layer(), cache, dim, tokens)
    assert fmt is not None and fmt.source == "probed"
    blocks = torch.randn(3, 2, heads, tokens, dim).to(torch.bfloat16)
    pages = fmt.blocks_to_pages(blocks, torch.zeros(3, heads, tokens, 2 * dim, dtype=torch.bfloat16))
    # where the backend keeps K (transposed) and V
    halves = pages.view(3, heads, 2, tokens * dim)
    assert torch.equal(halves[:, :, 0].view(3, heads, dim, tokens).transpose(2, 3), blocks[:, 0])
    assert torch.equal(halves[:, :, 1].view(3, heads, tokens, dim), blocks[:, 1])
    assert torch.equal(fmt.pages_to_blocks(pages), blocks)
    # the dense format would have read these pages wrongly
    assert not torch.equal(PageFormat.dense((heads, tokens, 2 * dim), dim).pages_to_blocks(pages), blocks)


class _Fp8Impl(_CpuStyleImpl):
    """The CPU layout in a ``uint8`` cache holding ``fmt`` (vLLM's fp8 caches)."""

    def __init__(self, fmt: torch.dtype) -> None:
        self.fmt = fmt

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        assert kv_cache.dtype == torch.uint8 and key.dtype == torch.bfloat16
        key, value, kv_cache = key.to(self.fmt), value.to(self.fmt), kv_cache.view(self.fmt)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_probe_learns_an_fp8_page_format_and_checks_the_format(fmt: torch.dtype) -> None:
    heads, tokens, dim = 2, 16, 64  # 4,096 elements: four base-8 digits
    cache = torch.zeros(4, heads, tokens, 2 * dim, dtype=torch.uint8)
    layer = type("Layer", (), {"impl": _Fp8Impl(fmt)})()
    found = PageFormat.probe(layer, cache, dim, tokens, elements=fmt, inputs=torch.bfloat16)
    assert found is not None and found.source == "probed"
    bf16_cache = torch.zeros(4, heads, tokens, 2 * dim, dtype=torch.bfloat16)
    bf16 = PageFormat.probe(_Layer(), bf16_cache, dim, tokens)
    assert bf16 is not None and torch.equal(found.index, bf16.index)  # the same placement
    other = torch.float8_e5m2 if fmt == torch.float8_e4m3fn else torch.float8_e4m3fn
    assert PageFormat.probe(layer, cache, dim, tokens, elements=other, inputs=torch.bfloat16) is None


def test_fp8_caches_get_fp8_layouts_and_other_quantized_caches_are_refused() -> None:
    from types import SimpleNamespace

    from kvstrata.integrations.vllm.layout import cache_dtype

    def config(name: str) -> SimpleNamespace:
        return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=name))

    assert cache_dtype(config("auto"), torch.bfloat16) is torch.bfloat16
    assert cache_dtype(config("fp8"), torch.uint8) is torch.float8_e4m3fn
    assert cache_dtype(config("fp8_e4m3"), torch.uint8) is torch.float8_e4m3fn
    assert cache_dtype(config("fp8_e5m2"), torch.uint8) is torch.float8_e5m2
    refused = (("int8_per_token_head", torch.int8), ("nvfp4", torch.uint8), ("fp8_ds_mla", torch.uint8))
    for name, allocated in refused:
        with pytest.raises(ConfigError, match=f"KV cache dtype '{name}'"):
            cache_dtype(config(name), allocated)


def test_dense_format_round_trip() -> None:
    fmt = PageFormat.dense((2, 4, 6), 3)
    pages = torch.randn(5, 2, 4, 6)
    blocks = fmt.pages_to_blocks(pages)
    assert torch.equal(blocks[:, 0], pages[..., :3]) and torch.equal(blocks[:, 1], pages[..., 3:])
    assert torch.equal(fmt.blocks_to_pages(blocks, torch.empty_like(pages)), pages)


def test_probe_without_a_backend_call_gives_none() -> None:
    assert PageFormat.probe(object(), torch.zeros(1, 2, 4, 6), 3, 4) is None


def test_in_place_page_writes_and_reads_match_the_general_path() -> None:
    heads, tokens, dim = 2, 16, 8
    cache = torch.zeros(4, heads, tokens, 2 * dim)
    fmt = PageFormat.probe(_Layer(), cache, dim, tokens)
    assert fmt is not None
    blocks = torch.randn(2, 2, heads, tokens, dim)
    assert fmt.write_page(cache[1], blocks[0]) and fmt.write_page(cache[3], blocks[1])
    expected = fmt.blocks_to_pages(blocks, torch.zeros(2, heads, tokens, 2 * dim))
    assert torch.equal(cache[[1, 3]], expected)
    out = torch.empty(2, 2, 3, heads, tokens, dim)  # (n, 2, L, H, N, D): fill layer 1
    fmt.read_pages_into(cache[[1, 3]], out[:, :, 1])
    assert torch.equal(out[:, :, 1], blocks)


class _Request:
    def __init__(self, req_id: str, tokens: list[int], **attrs: object) -> None:
        self.request_id = req_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.cache_salt = None
        self.kv_transfer_params = None
        self.mm_features = None
        self.prompt_embeds = None
        self.lora_request = None
        self.__dict__.update(attrs)


def test_scheduler_side_keys_namespaces_priorities_and_skips(tmp_path: Path) -> None:
    from kvstrata.integrations.vllm.scheduler import SchedulerSide
    from kvstrata.layout import KVLayout
    from kvstrata.store import KVStore
    from kvstrata.store.block import KVBlock

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4)
    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path)})
    tokens = list(range(3, 15))  # 12 tokens: 3 full blocks
    with KVStore(tmp_path, layout, model_fingerprint=b"w", config=cfg.store) as store:
        for i, key in enumerate(store.block_key_chain("default", tokens)):
            store.blocks.put(KVBlock(key, 4, 4 * i, torch.randn(layout.block_shape())), namespace="default")
        side = SchedulerSide(cfg, store)
        # every full block but the one holding the last token, loaded asynchronously
        assert side.get_num_new_matched_tokens(_Request("a", tokens), 0) == (8, True)
        # vLLM already holds the first block locally: only the second is loaded
        assert side.get_num_new_matched_tokens(_Request("b", tokens), 4) == (4, True)
        # another namespace (cache_salt), a LoRA adapter, an image: no hit
        assert side.get_num_new_matched_tokens(_Request("c", tokens, cache_salt="t1"), 0) == (0, False)
        assert side.get_num_new_matched_tokens(_Request("d", tokens, lora_request=object()), 0) == (0, False)
        assert side.get_num_new_matched_tokens(_Request("e", tokens, mm_features=[object()]), 0) == (0, False)
        req = _Request("f", tokens, kv_transfer_params={"kvstrata_priority": "background"})
        assert side.state(req).priority is Priority.BACKGROUND
        assert side.state(_Request("g", tokens)).priority is Priority.REALTIME
        sync = SchedulerSide(
            ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), "load_async": False}), store
        )
        assert sync.get_num_new_matched_tokens(_Request("h", tokens), 0) == (8, False)


def test_a_block_counts_only_when_every_tensor_parallel_rank_holds_its_shard(tmp_path: Path) -> None:
    """TP=2: the scheduler side counts a block as held only when both ranks' shards are stored;
    TP=1 (the base key) and TP=2 (rank keys) never find each other's blocks."""
    from kvstrata.integrations.vllm.scheduler import SchedulerSide
    from kvstrata.layout import KVLayout
    from kvstrata.store import KVStore
    from kvstrata.store.block import KVBlock

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4)
    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path)})
    tokens = list(range(3, 16))  # 13 tokens: 3 full blocks, all usable
    with KVStore(tmp_path, layout, model_fingerprint=b"w", config=cfg.store) as store:
        keys = store.block_key_chain("default", tokens)

        def put(key: bytes, pos: int) -> None:
            store.blocks.put(KVBlock(key, 4, pos, torch.randn(layout.block_shape())), namespace="default")  # type: ignore[arg-type]

        tp2, tp1 = SchedulerSide(cfg, store, tp_size=2), SchedulerSide(cfg, store, tp_size=1)
        for i, key in enumerate(keys):
            put(rank_key(key, 0, 2), 4 * i)  # rank 0 of every block
        put(rank_key(keys[0], 1, 2), 0)  # rank 1 of the first block only
        assert tp2.get_num_new_matched_tokens(_Request("a", tokens), 0)[0] == 4
        assert tp1.get_num_new_matched_tokens(_Request("b", tokens), 0)[0] == 0  # no TP=1 block
        put(rank_key(keys[1], 1, 2), 4)
        put(rank_key(keys[2], 1, 2), 8)
        assert tp2.get_num_new_matched_tokens(_Request("c", tokens), 0)[0] == 12
        put(keys[0], 0)  # a TP=1 block: TP=1 finds it, and TP=2 still needs both shards of the rest
        assert tp1.get_num_new_matched_tokens(_Request("d", tokens), 0)[0] == 4


def test_rank_keys() -> None:
    key = bytes(range(32))
    assert rank_key(key, 0, 1) == key  # TP=1: the base key, interchangeable with other integrations
    shards = [rank_key(key, r, 2) for r in range(2)] + [rank_key(key, r, 4) for r in range(4)]
    assert len(set(shards)) == 6 and key not in shards
    with pytest.raises(ConfigError):
        rank_key(key, 2, 2)


def test_store_dir_is_a_store_root(tmp_path: Path) -> None:
    from kvstrata.layout import KVLayout
    from kvstrata.store import KVStore
    from kvstrata.store.roots import layout_dir_name

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4)
    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path / "root")})
    assert cfg.store_path(layout) == tmp_path / "root" / layout_dir_name(layout)  # as the CLI lays it out
    KVStore(tmp_path / "old", layout).close()  # a store_dir that already is a store is used as it is
    assert ConnectorConfig.from_extra_config({"store_dir": str(tmp_path / "old")}).store_path(layout) == (
        tmp_path / "old"
    )


def test_load_settings(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path)})
    assert (cfg.load_async, cfg.on_load_error, cfg.event_log) == (True, "recompute", None)
    cfg = ConnectorConfig.from_extra_config(
        {"store_dir": str(tmp_path), "load_async": False, "on_load_error": "fail", "event_log": "~/ev.jsonl"}
    )
    assert (cfg.load_async, cfg.on_load_error) == (False, "fail")
    assert cfg.event_log == Path("~/ev.jsonl").expanduser()
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"on_load_error": "ignore"})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"load_async": "yes"})
