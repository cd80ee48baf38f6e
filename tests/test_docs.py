"""Every example in README.md and docs/*.md runs, as written, on the tiny random Llama.

Each fenced block says how it runs on the line before it (``tests/doc_blocks.py``): ``python``
blocks run as scripts and ``shell`` blocks with bash, each in a fresh directory, with
``$KVSTRATA_MODEL`` pointing at the tiny model (so ``load_model()`` and every ``kvstrata`` command
without ``--model`` use it) and ``$KVSTRATA_STORE`` at a fresh store root; ``server`` blocks run
against one ``kvstrata serve`` started for the module, with the base URL and the model name
rewritten to it. ``vllm`` blocks run in tests_vllm; ``skip`` blocks say why they do not run.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import kvstrata
from kvstrata.integrations.transformers.model import DEFAULT_GGUF_NAME, save_tiny_llama
from kvstrata.server.context import ServerConfig

from doc_blocks import DocBlock, all_blocks, blocks_of, check

BLOCK_TIMEOUT_S = 300
DOCUMENTED_URL = "http://127.0.0.1:8000"
TINY_NAME = "tiny-llama"
_MODEL_ARG = re.compile(r"""model\s*=\s*(["'])(?P<name>[^"']+)\1""")


def _ids(blocks: list[DocBlock]) -> list[str]:
    return [block.id for block in blocks]


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What a newcomer's shell has after ``make``: ``kvstrata`` and ``python`` on PATH; plus the tiny
    model as the default model, and stores and caches in temporary directories."""
    root = tmp_path_factory.mktemp("docs")
    model_dir = save_tiny_llama(root / TINY_NAME, seed=0)
    src = str(Path(kvstrata.__file__).resolve().parents[1])  # the code under test wins
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p),
        KVSTRATA_MODEL=str(model_dir),
        KVSTRATA_MODEL_CACHE=str(root / "model-cache"),
        KVSTRATA_STORE=str(root / "default-store"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def _run(
    argv: list[str], cwd: Path, env: dict[str, str], block: DocBlock
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, (
        f"{block.id} failed (exit {done.returncode}):\n{block.code}\n--- stdout\n{done.stdout[-4000:]}"
        f"\n--- stderr\n{done.stderr[-4000:]}"
    )
    return done


def test_every_code_block_says_how_it_runs() -> None:
    blocks, problems = all_blocks()
    problems += [problem for block in blocks if (problem := check(block))]
    assert not problems, "\n".join(problems)
    runnable = [block for block in blocks if block.mode in ("python", "shell", "server")]
    assert len(runnable) >= 5  # the parser found the README's examples


@pytest.mark.parametrize("block", blocks_of("python"), ids=_ids(blocks_of("python")))
def test_python_block(block: DocBlock, docs_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text(block.code)
    _run([sys.executable, "example.py"], tmp_path, docs_env, block)


@pytest.mark.parametrize("block", blocks_of("shell"), ids=_ids(blocks_of("shell")))
def test_shell_block(block: DocBlock, docs_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "example.sh").write_text(block.code)
    _run(["bash", "-euo", "pipefail", "example.sh"], tmp_path, docs_env, block)


# -- server blocks: one `kvstrata serve` on the tiny model for the module ---------------------------


@dataclass(frozen=True)
class Served:
    url: str
    model_name: str


@pytest.fixture(scope="module")
def served(docs_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("docs-serve")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = root / "serve.log"
    kvstrata_bin = str(Path(sys.executable).parent / "kvstrata")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [kvstrata_bin, "serve", "--store", str(root / "store"), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=docs_env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                pytest.fail(f"kvstrata serve exited ({process.returncode}):\n{log_path.read_text()}")
            try:
                health = httpx.get(f"{url}/healthz", timeout=2)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"kvstrata serve did not start:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield Served(url, str(health.json()["model"]))
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_server_blocks_name_a_model_the_default_server_serves() -> None:
    """The README's client names the model as `kvstrata serve` on SmolLM2 answers to (it serves
    "SmolLM2-135M-Instruct.Q4_1" and accepts the name without the quantisation suffix)."""
    default = ServerConfig(model_name=Path(DEFAULT_GGUF_NAME).stem)
    names = [m["name"] for block in blocks_of("server") for m in _MODEL_ARG.finditer(block.code)]
    assert names, "no server block names a model"
    assert all(default.serves(name) for name in names), (names, default.model_name)


@pytest.mark.parametrize("block", blocks_of("server"), ids=_ids(blocks_of("server")))
def test_server_block(block: DocBlock, served: Served, docs_env: dict[str, str], tmp_path: Path) -> None:
    assert DOCUMENTED_URL in block.code, f"{block.id}: a server block talks to {DOCUMENTED_URL}"
    code = block.code.replace(DOCUMENTED_URL, served.url)
    code = _MODEL_ARG.sub(lambda m: f"model={m[1]}{served.model_name}{m[1]}", code)
    (tmp_path / "client.py").write_text(code)
    _run([sys.executable, "client.py"], tmp_path, docs_env, block)
