"""vLLM's own serving benchmark client against ``kvstrata serve``: every request succeeds.

The client (``vllm.benchmarks.serve``, backend ``openai-chat``, dataset ``prefix_repetition``)
runs here, in .venv-vllm; the server is the core venv's ``kvstrata serve`` in a child process,
running this checkout's code. The core venv's ``kvstrata`` is ``$KVSTRATA_CORE_BIN``, by default
``.venv/bin/kvstrata`` of this checkout (what ``make`` creates).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import HERE

REPO = HERE.parent
CORE_KVSTRATA = Path(os.environ.get("KVSTRATA_CORE_BIN", REPO / ".venv" / "bin" / "kvstrata"))
NUM_PROMPTS = 12
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def served(work_dir: Path) -> Iterator[tuple[str, Path]]:
    """``kvstrata serve`` on a tiny model; (base URL, model directory)."""
    from kvstrata.integrations.transformers.model import save_tiny_llama

    if not CORE_KVSTRATA.is_file():
        pytest.fail(f"no kvstrata at {CORE_KVSTRATA}: run `make` or set KVSTRATA_CORE_BIN")
    model = save_tiny_llama(work_dir / "serve-tiny", seed=0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),  # this checkout's code, whichever venv installed kvstrata
        "KVSTRATA_MODEL_CACHE": str(work_dir / "serve-cache"),
    }
    log_path = work_dir / "serve.log"
    command = [str(CORE_KVSTRATA), "serve", "--model", str(model), "--store", str(work_dir / "serve-store")]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                pytest.fail(f"kvstrata serve exited ({process.returncode}):\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"kvstrata serve did not start:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url, model
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_vllm_bench_serve_openai_chat_prefix_repetition(served: tuple[str, Path], work_dir: Path) -> None:
    url, model = served
    command = [
        sys.executable, str(HERE / "vllm_bench_serve.py"),
        "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", model.name, "--tokenizer", str(model),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "256", "--prefix-repetition-suffix-len", "32",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--temperature", "0", "--ignore-eos",
        "--seed", "0", "--save-result", "--result-dir", str(work_dir), "--result-filename", "bench.json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((work_dir / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), result.get("errors")
    # ignore_eos (sent with --ignore-eos) is honoured: every request generated the full length
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["mean_ttft_ms"] > 0 and result["output_throughput"] > 0
    # the repeated prefixes were reused across these stateless requests (shared full blocks)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    reused = [line for line in metrics.splitlines() if line.startswith("kvstrata_cached_prompt_tokens_sum")]
    assert float(reused[0].split()[-1]) > 0
