"""vLLM's OpenAI server, started the documented way on the CPU build, for the connector's tests.

``python -m vllm.entrypoints.openai.api_server`` in vLLM's default multi-process mode (an API
server process, the EngineCore process with the scheduler, a worker process per tensor-parallel
rank), in a process group of its own so a test can SIGTERM or SIGKILL all of it. Requests go
through the official ``openai`` client; greedy output token ids come back with vLLM's
``return_token_ids``, and ``cached_tokens`` with ``--enable-prompt-tokens-details``. vLLM's own
prefix cache is off, so every cached token comes from the connector.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "tiny"
START_TIMEOUT_S = 420
_METRIC = re.compile(r"^(?P<name>[a-z_:]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM process: this checkout's kvstrata, offline, a small KV space."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # vLLM reserves one more core when a KV connector is configured; the same reservation
            # for every server keeps their thread counts, and so their arithmetic, equal
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
        }
    )
    env.update(extra)
    return env


def kvstrata_cli() -> list[str]:
    """The core venv's ``kvstrata`` command (vLLM's venv has other pins): ``$KVSTRATA_CLI``, else
    this repository's ``.venv/bin/kvstrata``, else the project's usual checkout."""
    configured = os.environ.get("KVSTRATA_CLI")
    candidates = [Path(configured)] if configured else []
    candidates += [REPO / ".venv" / "bin" / "kvstrata", Path("/work/main/.venv/bin/kvstrata")]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return [str(path)]
    found = shutil.which("kvstrata")
    if found and not configured:
        return [found]
    raise RuntimeError(
        "no kvstrata command found for the core venv; run `make` (it builds .venv) or set KVSTRATA_CLI "
        f"(tried: {', '.join(str(p) for p in candidates)})"
    )


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvstrata ARGS`` with this checkout's code, as an operator would run it beside a server."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [*kvstrata_cli(), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@dataclass
class Reply:
    tokens: list[int]
    cached_tokens: int


class Server:
    """One vLLM OpenAI server; with ``store_root``, the kvstrata connector on that store root."""

    def __init__(
        self,
        work_dir: Path,
        name: str,
        model: Path,
        *,
        store_root: Path | None = None,
        extra: dict[str, Any] | None = None,
        tensor_parallel: int = 1,
        max_model_len: int = 1024,
    ) -> None:
        self.work_dir = work_dir
        self.name = name
        self.model = model
        self.store_root = store_root
        self.event_log = work_dir / f"{name}.events.jsonl" if store_root is not None else None
        self.extra = dict(extra or {})
        self.tensor_parallel = tensor_parallel
        self.max_model_len = max_model_len
        self.port = free_port()
        self.log_path = work_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--enforce-eager", "--dtype", "float32",
            "--seed", "0", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.tensor_parallel > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel)]
            cmd += ["--distributed-executor-backend", "mp"]
        if self.store_root is not None:
            extra = {"store_dir": str(self.store_root), "event_log": str(self.event_log), **self.extra}
            config = {
                "kv_connector": "KVStrataConnector",
                "kv_connector_module_path": "kvstrata.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
            cmd += ["--kv-transfer-config", json.dumps(config)]
        return cmd

    def start(self) -> Server:
        """Start the server (use :meth:`wait_ready`); in a session of its own, so that
        :meth:`stop` signals every process of it."""
        env = server_env()
        if self.tensor_parallel > 1:
            # vLLM binds each CPU worker to a NUMA node of its own; this machine has one
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(self.command())}\n".encode())
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.work_dir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Server:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise AssertionError(f"server {self.name} exited ({code}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as health:
                    if health.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                tail = self.log_tail()
                raise AssertionError(f"server {self.name} did not start in {timeout:.0f} s:\n{tail}")
            time.sleep(1)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", timeout=300, max_retries=0)

    def complete(self, tokens: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> Reply:
        """A greedy completion of the prompt ``tokens`` (token ids), through the openai client."""
        body: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        out = self.client().completions.create(
            model=MODEL_NAME, prompt=tokens, max_tokens=max_tokens, temperature=0.0, extra_body=body
        )
        choice = out.choices[0]
        token_ids = getattr(choice, "token_ids", None)
        assert token_ids is not None, f"vLLM returned no token ids: {choice}"
        details = out.usage.prompt_tokens_details if out.usage is not None else None
        cached = getattr(details, "cached_tokens", None) or 0
        return Reply(list(token_ids), int(cached))

    def metrics(self) -> dict[str, float]:
        """vLLM's counters: ``{"name": value, "name{source=disk}": value}`` (model and engine
        labels dropped)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match is None:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels") or ""))
            extra = {k: v for k, v in labels.items() if k not in ("model_name", "engine")}
            key = match.group("name") + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))
            out[key] = out.get(key, 0.0) + float(match.group("value"))
        return out

    def hits_by_source(self) -> dict[str, float]:
        """Cached prompt tokens per source, as vLLM counts them (the connector's hits)."""
        found = {}
        prefix = "vllm:prompt_tokens_cached_by_source_total{source="
        for key, value in self.metrics().items():
            if key.startswith(prefix):
                found[key[len(prefix) : -1]] = value
        return found

    def events(self) -> list[dict[str, Any]]:
        from kvstrata.integrations.vllm.events import read_events

        return read_events(self.event_log) if self.event_log is not None else []

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 90) -> int:
        """Send ``sig`` to the server's whole process group and wait for it; its exit code."""
        process = self.process
        if process is None:
            return 0
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group(process.pid)
        self.process = None
        return int(process.returncode)

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    @staticmethod
    def _reap_group(pgid: int, timeout: float = 30) -> None:
        """Wait until no process of the group is left (vLLM's workers outlive the API server for
        a moment); SIGKILL what remains after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def start_all(*servers: Server) -> None:
    """Start ``servers`` together and wait until all of them answer."""
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop(signal.SIGKILL)
        raise
