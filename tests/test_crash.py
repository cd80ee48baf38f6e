"""Acceptance 4: SIGKILL a writer at random moments; every session reads back to its checkpoint."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvstrata import KVStore

from conftest import LAYOUT, token_kv

TRIALS = 30


def test_sigkill_at_random_moments_loses_nothing_checkpointed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    rng = random.Random(7)
    writer = Path(__file__).with_name("crash_writer.py")
    verified_sessions = 0
    for trial in range(TRIALS):
        child = subprocess.Popen(
            [sys.executable, str(writer), str(root), str(trial)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        with KVStore(root, LAYOUT, model_fingerprint=b"test-model") as store:
            for info in store.list_sessions():
                session = store.session(info.id, info.namespace)
                loaded = store.load(session)
                assert loaded.missing_from_token is None, f"trial {trial}: {info.id} lost data"
                assert loaded.num_tokens == session.num_tokens
                if session.num_tokens:
                    assert torch.equal(loaded.kv, token_kv(LAYOUT, session.token_ids)), (
                        f"trial {trial}: {info.id}"
                    )
                verified_sessions += 1
            assert not list((root / "tmp").iterdir())  # temp files of the killed writer were removed
    assert verified_sessions >= TRIALS * 4
