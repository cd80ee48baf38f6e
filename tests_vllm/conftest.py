"""Fixtures of the vLLM connector tests (run with .venv-vllm: ``make test-vllm``).

Every engine runs in a child process (``vllm_job.py``) on tiny random-weight Llamas saved here with
``save_pretrained`` and an offline byte-level tokenizer; nothing is fetched from any hub.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))  # redis_servers: real redis-server processes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BLOCK = 128  # vLLM's block size on the CPU backend = kvstrata's block_tokens
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
    prefix_len: int


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
        prefix + _tokens(rng, 50), prefix + _tokens(rng, 70), _tokens(rng, 2 * BLOCK + 30), len(prefix)
    )


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
