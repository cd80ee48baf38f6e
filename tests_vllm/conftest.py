"""Fixtures of the vLLM connector tests (run with .venv-vllm: ``make test-vllm``).

Every engine runs in processes of its own on tiny random-weight Llamas saved here with
``save_pretrained`` and an offline byte-level tokenizer; nothing is fetched from any hub. Most
tests run vLLM's OpenAI server in its default multi-process mode (``servers.py``); a few run the
offline ``LLM`` class in one process (``vllm_job.py``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))  # redis_servers: real redis-server processes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BLOCK = 128  # vLLM's block size on the CPU backend = kvstrata's block_tokens
LAYOUT_ARGS = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float32", "block_tokens": BLOCK}
VOCAB_LOW, VOCAB_HIGH = 3, 259  # the tiny tokenizer's byte tokens
JOB_TIMEOUT_S = 420


@dataclass(frozen=True)
class Models:
    a: Path
    b: Path  # same geometry as a, other weights


@dataclass(frozen=True)
class Prompts:
    p1: list[int]  # shared prefix + suffix 1
    p2: list[int]  # shared prefix + suffix 2
    q1: list[int]  # another long prompt
    q2: list[int]  # and two more
    q3: list[int]
    prefix_len: int

    def named(self) -> dict[str, list[int]]:
        return {"p1": self.p1, "p2": self.p2, "q1": self.q1, "q2": self.q2, "q3": self.q3}


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm")
    # weight fingerprints are cached here, not in the user's cache
    os.environ["KVSTRATA_MODEL_CACHE"] = str(path / "model-cache")
    return path


@pytest.fixture(scope="session")
def models(work_dir: Path) -> Models:
    from kvstrata.integrations.transformers.model import save_tiny_llama

    geometry = {"num_layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2}  # head dim 64
    return Models(
        save_tiny_llama(work_dir / "tiny-a", seed=1, **geometry),
        save_tiny_llama(work_dir / "tiny-b", seed=2, **geometry),
    )


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


@pytest.fixture(scope="session")
def prompts() -> Prompts:
    rng = random.Random(1234)
    prefix = _tokens(rng, 3 * BLOCK + 40)  # three full blocks and a partial one
    return Prompts(
        prefix + _tokens(rng, 50),
        prefix + _tokens(rng, 70),
        _tokens(rng, 2 * BLOCK + 30),
        _tokens(rng, 3 * BLOCK + 5),
        _tokens(rng, 2 * BLOCK + 60),
        len(prefix),
    )


MAX_TOKENS = 8


@pytest.fixture(scope="session")
def baseline(work_dir: Path, models: Models, prompts: Prompts) -> dict[str, list[int]]:
    """The greedy output of every prompt on model A from vLLM's server without any connector."""
    from servers import Server

    server = Server(work_dir, "baseline", models.a).start().wait_ready()
    try:
        return {name: server.complete(tokens, MAX_TOKENS).tokens for name, tokens in prompts.named().items()}
    finally:
        server.stop()


def fingerprint(model: Path) -> bytes:
    from kvstrata.integrations.transformers.model import fingerprint_model_dir

    return fingerprint_model_dir(model)


def block_keys(model: Path, tokens: list[int], namespace: str = "default", kv_heads: int = 2) -> list[bytes]:
    """The connector's (base) keys of the full blocks of ``tokens``; ``kv_heads``: per rank (the
    layout is part of every key)."""
    from kvstrata.keys import chain_keys, root_key
    from kvstrata.layout import KVLayout

    layout = KVLayout(**{**LAYOUT_ARGS, "num_kv_heads": kv_heads})  # type: ignore[arg-type]
    return chain_keys(root_key(fingerprint(model), layout, namespace), tokens, BLOCK)


def store_path(root: Path) -> Path:
    """The one store the connector keeps under the store root ``root`` (root/<layout>/)."""
    found = [child for child in root.iterdir() if (child / "index.sqlite").is_file()]
    assert len(found) == 1, f"expected one store under {root}: {sorted(p.name for p in root.iterdir())}"
    return found[0]


def indexed(root: Path, keys: list[bytes]) -> list[bool]:
    """Whether the store's index (L3) holds each of ``keys``, asked read-only beside the servers."""
    from kvstrata.config import StoreConfig
    from kvstrata.store import KVStore

    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)
    with KVStore(store_path(root), read_only=True, config=config) as store:
        return [store.blocks.contains(key) for key in keys]  # type: ignore[arg-type]


def wait_indexed(root: Path, keys: list[bytes], timeout: float = 60) -> None:
    """Wait until the servers' background saves of ``keys`` reached the disk tier."""
    deadline = time.monotonic() + timeout
    while not all(indexed(root, keys)):
        assert time.monotonic() < deadline, f"blocks not on disk after {timeout} s: {indexed(root, keys)}"
        time.sleep(0.2)


def block_file(store: Path, key: bytes) -> tuple[Path, int, int]:
    """Where the block's record is now: (file, offset, bytes); a checkpoint's blocks share one
    segment file, a block written alone has a file of its own (offset 0)."""
    from kvstrata import KVStore, StoreConfig

    with KVStore(store, read_only=True, config=StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)) as kv:
        found = kv.disk.locate(key)  # type: ignore[arg-type]
    assert found is not None, f"no record for block {key.hex()} in {store}"
    return found


def corrupt(record: tuple[Path, int, int]) -> None:
    """Flip one byte in the middle of a block's record (its payload): its CRC32C no longer matches."""
    path, offset, nbytes = record
    with open(path, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)[0]
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte ^ 0x5A]))


def run_job(work_dir: Path, name: str, phases: list[dict]) -> list[dict]:
    """Run ``phases`` in one fresh process; the per-phase results."""
    spec_path = work_dir / f"{name}.spec.json"
    out_path = work_dir / f"{name}.out.json"
    spec_path.write_text(json.dumps({"phases": phases}))
    log_path = work_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "vllm_job.py"), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=JOB_TIMEOUT_S,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
    if proc.returncode != 0:
        tail = log_path.read_text()[-4000:]
        raise AssertionError(f"vLLM job {name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out_path.read_text())["phases"]


def request(tokens: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> dict:
    out: dict = {"prompt_token_ids": tokens, "max_tokens": max_tokens}
    if cache_salt:
        out["cache_salt"] = cache_salt
    return out


def kvstrata_phase(model: Path, store: Path, rounds: list[list[dict]], **extra: object) -> dict:
    return {
        "model": str(model),
        "connector": "kvstrata",
        "extra_config": {"store_dir": str(store), **extra},
        "rounds": rounds,
    }


def plain_phase(model: Path, rounds: list[list[dict]]) -> dict:
    return {"model": str(model), "connector": None, "rounds": rounds}
