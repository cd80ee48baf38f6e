"""One agent's blocks held by grade (issue 33) survive the store: the grades are kept in the
session's index row (format 5), so a restart, or another process, restoring the session from L3
puts each block back at its grade; a store of format 4 still opens."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvstrata.codecs import CodecId
from kvstrata.layout import KVLayout
from kvstrata.policy.grades import GradedCodecs
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store import KVStore
from kvstrata.store.index.db import INDEX_FORMAT_VERSION
from kvstrata.store.sessions import Session
from kvstrata.tiering import TierLevel

from conftest import token_kv

Factory = Callable[..., KVStore]
FP32 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_tokens=64)
# what each block receives while recent: chosen so that no block's grade ever rises as later ones
# join (a grade that rises cannot regain precision in device memory, while a restore from an exact
# enough L3 copy would: the two would then differ by design)
MASS = [0.22, 0.42, 0.03, 0.22, 0.44, 0.5, 0.23, 0.23]
_CONFIG = """dict(
    ladder=CodecLadder(
        background=Rung("kivi4", "kivi4", "graded"), recent_blocks=1,
        grades=GradedCodecs("int8s", "kivi4", "kivi2", top_share=0.2, bottom_share=0.4),
    ),
    l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0,
)"""


def _config() -> dict[str, object]:
    """The store's configuration: the same text the second process runs."""
    names = {"CodecLadder": CodecLadder, "Rung": Rung, "GradedCodecs": GradedCodecs, "FP32": FP32}
    return eval(_CONFIG, names)  # a constant of this module


def _held(store: KVStore, session: Session) -> list[str]:
    """The codec device memory holds each of the session's blocks in, by name."""
    l1 = store.tiered.tier(TierLevel.L1)
    return [CodecId(l1.codec_of(k)).name.lower() for k in session.all_keys()]  # type: ignore[arg-type]


def _graded(open_store: Factory, root: Path, config: dict[str, object] | None = None) -> list[str]:
    """A background session on a graded rung, appended a block at a time (each attended while
    recent), checkpointed; the codecs device memory holds its blocks in."""
    store = open_store(root, FP32, **(config or _config()))
    session = store.create_session("graded", priority="background")
    tokens = [i % 997 for i in range(8 * 64 + 10)]
    kv = token_kv(FP32, tokens)
    for b in range(8):
        store.append(session, tokens[b * 64 : (b + 1) * 64], kv[:, :, :, b * 64 : (b + 1) * 64])
        store.blocks.add_importance([(session.block_keys[b], MASS[b])])
    store.append(session, tokens[8 * 64 :], kv[:, :, :, 8 * 64 :])  # a tail
    store.flush()
    store.tiered.reencoder.flush()
    held = _held(store, session)
    store.checkpoint(session)
    store.close()
    return held


def _restore(store: KVStore) -> list[str]:
    session = store.session("graded")
    loaded = store.load(session, paged=True)
    assert loaded.num_tokens == 8 * 64 + 10 and loaded.missing_from_token is None
    assert set(loaded.tokens_by_tier) == {TierLevel.L3}  # device memory started empty
    store.tiered.reencoder.flush()
    return _held(store, session)


def test_a_restart_and_another_process_restore_each_block_at_its_grade(
    open_store: Factory, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    held = _graded(open_store, root)
    # sinks, the recent window and the tail exact; the most attended int8s, the least kivi2
    assert held == ["identity", "kivi4", "kivi2", "kivi2", "int8s", "int8s", "kivi4", "identity", "identity"]
    store = open_store(root, FP32, **_config())
    assert _restore(store) == held  # reopened in this process
    store.close()
    code = f"""
import json, sys
from kvstrata.codecs import CodecId
from kvstrata.config import StoreConfig
from kvstrata.layout import KVLayout
from kvstrata.policy.grades import GradedCodecs
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store import KVStore
from kvstrata.tiering import TierLevel
FP32 = KVLayout.from_json({FP32.to_json()!r})
store = KVStore(sys.argv[1], FP32, model_fingerprint=b"test-model", config=StoreConfig(**{_CONFIG}))
session = store.session("graded")
loaded = store.load(session, paged=True)
store.tiered.reencoder.flush()
l1 = store.tiered.tier(TierLevel.L1)
print(json.dumps([sorted(l.name for l in loaded.tokens_by_tier),
                  [CodecId(l1.codec_of(k)).name.lower() for k in session.all_keys()]]))
store.close()
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300, check=True
    )
    tiers, other = json.loads(out.stdout.strip().splitlines()[-1])
    assert tiers == ["L3"] and other == held  # another process


def test_the_default_grades_hold_kvmix_blocks_and_come_back_after_a_restart(
    open_store: Factory, tmp_path: Path
) -> None:
    """The default graded rung (top KIVI-4, the rest kvmix): L3 keeps the class's KIVI-4 copies
    (less lossy than kvmix), and a restore re-encodes each block to its grade in device memory."""
    ladder = CodecLadder(background=Rung("kivi4", "kivi4", "graded"), recent_blocks=1)
    config: dict[str, object] = dict(
        ladder=ladder, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0
    )
    root = tmp_path / "store"
    held = _graded(open_store, root, config)
    # the most attended of the older blocks (block 5) KIVI-4, the others kvmix
    assert held == ["identity", "kvmix", "kvmix", "kvmix", "kvmix", "kivi4", "kvmix", "identity", "identity"]
    store = open_store(root, FP32, **config)
    assert _restore(store) == held
    store.close()


def test_a_format_4_store_opens_and_its_sessions_get_grades(open_store: Factory, tmp_path: Path) -> None:
    """A row of format 4 (no grades column; its checksum over the columns before it) reads, and
    its session, once graded, keeps its grades in the migrated row."""
    root = tmp_path / "store"
    store = open_store(root, FP32, **_config())
    session = store.create_session("s", priority="interactive")  # not graded: no grades
    tokens = [i % 997 for i in range(4 * 64)]
    store.append(session, tokens, token_kv(FP32, tokens))
    store.checkpoint(session)
    store.close()
    with sqlite3.connect(root / "index.sqlite") as db:  # as a build of format 4 left it
        db.execute("ALTER TABLE sessions DROP COLUMN grades")
        db.execute("UPDATE meta SET value = '4' WHERE name = 'format_version'")
    with KVStore(root, read_only=True) as old:  # read as it is
        assert old.session("s").grades is None and old.session("s").token_ids == tokens
    store = open_store(root, FP32, **_config())
    assert store.index.get_meta("format_version") == str(INDEX_FORMAT_VERSION) == "5"
    session = store.session("s")
    assert session.grades is None and session.token_ids == tokens
    store.set_priority(session, "background")  # a graded class from now on
    more = [7] * 64
    store.append(session, more, token_kv(FP32, more, start_pos=4 * 64))
    assert session.grades is not None and len(session.grades) == 1 + 5 * len(session.block_keys)
    store.checkpoint(session)
    store.close()
    assert open_store(root, FP32, **_config()).session("s").grades == session.grades


def test_grades_travel_with_the_session_manifest(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    _graded(open_store, root)
    session = open_store(root, FP32, **_config()).session("graded")
    assert session.grades is not None
    back = Session.from_manifest(session.to_manifest(), 1)
    assert back.grades == session.grades
    plain = Session("ns", "plain", b"test-model")
    assert "grades" not in json.loads(json.loads(plain.to_manifest())["body"])
    assert Session.from_manifest(plain.to_manifest(), 1).grades is None


def test_a_truncated_session_keeps_the_grades_of_its_blocks(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    _graded(open_store, root)
    store = open_store(root, FP32, **_config())
    session = store.session("graded")
    before = session.grades
    assert before is not None
    store.truncate(session, 5 * 64 + 10)  # five full blocks and a tail of ten tokens
    # graded again over the five it keeps (the last of them now the recent window)
    assert session.grades is not None and len(session.block_keys) == 5 and len(session.grades) == 1 + 5 * 5
    assert session.grades[1 + 4 * 5] == 1 and before[1 + 4 * 5] != 1  # code 1: recent
    store.checkpoint(session)
    store.close()
    again = open_store(root, FP32, **_config()).session("graded")
    assert again.grades == session.grades and again.num_tokens == 5 * 64 + 10
