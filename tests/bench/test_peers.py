"""``kvstrata bench peers`` without llama-cpp-python installed: a clear message, before any
model is loaded."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from kvstrata.bench import peers
from kvstrata.cli.main import app
from kvstrata.errors import ConfigError


def test_run_without_llama_cpp_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(ConfigError, match=r"kvstrata\[peers\]"):
        peers.run(contexts=[64])


def test_cli_without_llama_cpp_exits_with_the_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    result = CliRunner().invoke(app, ["bench", "peers", "--contexts", "64"])
    assert result.exit_code == 1
    assert "llama-cpp-python" in result.output
    assert "pip install" in result.output


def test_cli_rejects_bad_contexts() -> None:
    result = CliRunner().invoke(app, ["bench", "peers", "--contexts", "x"])
    assert result.exit_code == 1
    assert "not an integer" in result.output
