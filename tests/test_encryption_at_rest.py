"""Issue 30, acceptance 5: with a key, no conversation text and no token id sequence can be
recovered from any file of the store; listing its sessions needs the key.

The check greps every file under the store root for the prompt's text and for every run of the
conversation's token ids as unsigned 16/32/64-bit integers (both byte orders) and as decimal text
(JSON and plain). The same grep over the same chat in a store without a key must find them: the
test shows that its detector works before it trusts "nothing found"."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import kvstrata
from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.integrations.transformers.model import save_tiny_llama
from kvstrata.server.audit import AuditLog, read_audit

KEY = bytes(range(32))
SECRET = "My bank password is zebra-horse-42"
KVSTRATA = str(Path(sys.executable).parent / "kvstrata")
RUN = 6
"""Tokens in a run looked for (one run of six ids in a row is the conversation, not chance)."""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("at-rest")
    src = str(Path(kvstrata.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p),
        KVSTRATA_MODEL=str(save_tiny_llama(root / "tiny", seed=0)),
        KVSTRATA_MODEL_CACHE=str(root / "model-cache"),
    )
    return env


def kv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSTRATA, *args], env=env, capture_output=True, text=True, timeout=300)


def encodings(token_ids: list[int]) -> list[bytes]:
    """Every run of ``RUN`` ids in every integer width, byte order and decimal spelling."""
    found = []
    for start in range(0, max(1, len(token_ids) - RUN + 1)):
        run = token_ids[start : start + RUN]
        for width in ("u2", "u4", "u8"):
            for order in "<>":
                raw = np.asarray(run, dtype=f"{order}{width}").tobytes()
                found += [raw, base64.b64encode(raw)]
        for sep in (", ", ",", " ", "\n"):
            found.append(sep.join(str(t) for t in run).encode())
    return found


def leaks(root: Path, extra: list[Path], token_ids: list[int]) -> list[str]:
    """(file, what) for each place the secret text or a run of the token ids appears."""
    patterns = [(SECRET.encode(), "text"), (b"zebra-horse", "text"), (json.dumps(SECRET).encode(), "text")]
    patterns += [(p, "token ids") for p in encodings(token_ids)]
    found = []
    for path in [p for p in root.rglob("*") if p.is_file()] + extra:
        data = path.read_bytes()
        found += [f"{path}: {what}" for pattern, what in patterns if pattern in data]
    return sorted(set(found))


def chat_and_collect(env: dict[str, str], store: Path, tmp_path: Path, key: bytes | None) -> list[str]:
    """Two turns of `kvstrata chat`, an export and an audit log; the leaks found."""
    if key is not None:
        env = {**env, "KVSTRATA_ENCRYPTION_KEY": key.hex()}
    for text in (SECRET, "Say it again."):
        done = kv(env, "chat", "--store", str(store), "-s", "a", "--max-new-tokens", "4", "--json", text)
        assert done.returncode == 0, done.stderr
    (layout_dir,) = [p.parent for p in store.glob("*/index.sqlite")]
    config = StoreConfig(encryption_key=key)
    with KVStore(layout_dir, config=config) as opened:
        session = opened.session("a")
        token_ids = list(session.token_ids)
        exported = tmp_path / "a.kvsarc"
        exported.write_bytes(opened.archives.export_session(session))
    audit = AuditLog(tmp_path / "audit.jsonl", key=key)
    audit.record("export", tenant="default", client="127.0.0.1:1", session="a", note=SECRET)
    audit.close()
    assert read_audit(tmp_path / "audit.jsonl", key=key)[0]["note"] == SECRET
    return leaks(store, [exported, tmp_path / "audit.jsonl"], token_ids)


def test_the_detector_finds_a_clear_conversation(env: dict[str, str], tmp_path: Path) -> None:
    found = chat_and_collect(env, tmp_path / "kv", tmp_path, key=None)
    assert any("index.sqlite" in f and "token ids" in f for f in found), found
    assert any("index.sqlite" in f and "text" in f for f in found), found  # the transcript
    assert any("a.kvsarc" in f for f in found) and any("audit.jsonl" in f for f in found), found


def test_an_encrypted_store_keeps_no_conversation_in_the_clear(env: dict[str, str], tmp_path: Path) -> None:
    store = tmp_path / "kv"
    assert chat_and_collect(env, store, tmp_path, key=KEY) == []
    # listing and statistics need the key: one line without it, the sessions with it; the
    # command a user would try first runs as they would run it, the others in this process
    denied = kv(env, "sessions", "list", "--store", str(store))
    assert denied.returncode == 1 and len(denied.stderr.strip().splitlines()) == 1, denied.stderr
    assert "encrypted" in denied.stderr and denied.stdout == ""
    for command in (["store", "stats"], ["sessions", "show", "a"], ["gc"]):
        done = CliRunner().invoke(app, [*command, "--store", str(store)], env={"KVSTRATA_ENCRYPTION_KEY": ""})
        assert done.exit_code == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "encrypted" in done.stderr and done.stdout == "", done.output
    keyed = {**env, "KVSTRATA_ENCRYPTION_KEY": KEY.hex()}
    listed = CliRunner().invoke(app, ["sessions", "list", "--store", str(store), "--json"], env=keyed)
    assert listed.exit_code == 0 and [s["id"] for s in json.loads(listed.stdout)] == ["a"]
    # the conversation goes on with the key, history included
    again = kv(
        keyed, "chat", "--store", str(store), "-s", "a", "--max-new-tokens", "2", "--json", "Once more."
    )
    assert again.returncode == 0 and json.loads(again.stdout)["cached_tokens"] > 0
