"""StoreConfig read from a mapping by StoreConfig itself (the vLLM connector's settings use it)."""

from __future__ import annotations

import pytest

from kvstrata.config import NamespaceQuota, StoreConfig, WritePolicy
from kvstrata.errors import ConfigError
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.tiering import RemoteConfig


def test_every_kind_of_field_is_read_from_a_mapping() -> None:
    config = StoreConfig.from_mapping(
        {
            "l1_budget_bytes": "64MiB",
            "l2_budget_bytes": 1 << 30,
            "l3_budget_bytes": "10GiB",
            "high_watermark": 0.9,
            "low_watermark": 1 / 2,
            "write_policy": "write-back",
            "l1_idle_demote_s": None,
            "l2_idle_demote_s": 60,
            "l3_direct_reads": False,
            "device": "cpu",
            "ladder": {"interactive": {"l3": "kivi4"}, "background": "kivi2"},
            "remote": {"url": "redis://127.0.0.1:6379", "ttl_s": 3600, "cluster": False},
            "encryption_key": "ab" * 32,
            "namespace_quotas": {"team-a": {"l1_bytes": "1MiB"}},
        }
    )
    assert config.l1_budget_bytes == 64 << 20 and config.l3_budget_bytes == 10 << 30
    assert config.high_watermark == 0.9 and config.low_watermark == 0.5
    assert config.write_policy is WritePolicy.WRITE_BACK
    assert config.l1_idle_demote_s is None and config.l2_idle_demote_s == 60.0
    assert config.l3_direct_reads is False and config.l3_direct_writes is True
    assert config.ladder.interactive == Rung("int8", "kivi4", "int8s")  # L1 keeps its default
    assert config.ladder.background == Rung("kivi2", "kivi2", "kivi4")
    assert config.remote == RemoteConfig("redis://127.0.0.1:6379", ttl_s=3600)
    assert config.encryption_key == bytes.fromhex("ab" * 32)
    assert config.namespace_quotas == {"team-a": NamespaceQuota(l1_bytes=1 << 20)}
    assert StoreConfig.from_mapping({}) == StoreConfig()
    assert StoreConfig.from_mapping({"ladder": "exact"}).ladder == CodecLadder.exact()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"l1_budget": 1}, "unknown keys l1_budget"),
        ({"l3_direct_reads": "no"}, "l3_direct_reads must be true or false"),
        ({"high_watermark": "high"}, "high_watermark must be a number"),
        ({"checkpoint_every_tokens": True}, "checkpoint_every_tokens must be an integer"),
        ({"write_policy": "sometimes"}, "write_policy must be one of write-through, write-back"),
        ({"l2_budget_bytes": "lots"}, "l2_budget_bytes must be a size"),
        ({"remote": {"url": "redis://h:1", "ttl": 5}}, "remote: unknown keys ttl"),
        ({"remote": {"url": "http://h"}}, "remote URL must start with"),
        ({"ladder": {"realtime": "no-such-codec"}}, "unknown codec"),
        ({"encryption_key": "zz"}, "encryption_key must be 64 hex characters"),
        ({"namespace_quotas": ["a"]}, "namespace_quotas must be an object"),
    ],
)
def test_a_bad_value_is_one_config_error_naming_its_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig.from_mapping(data)


def test_a_nested_key_is_named_by_its_path() -> None:
    with pytest.raises(ConfigError, match=r"connector\.remote\.timeout_s must be a number"):
        StoreConfig.from_mapping({"remote": {"url": "redis://h:1", "timeout_s": "fast"}}, "connector")
