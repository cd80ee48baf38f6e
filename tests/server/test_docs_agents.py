"""docs/agents.md: every fenced block says how it runs, and each ``server`` block runs, as
written, against a live server on the tiny model (base URL and model name rewritten to it).

(A focused copy of tests/test_docs.py's convention for this page; that test may fold it in.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_builders import MODEL_NAME, LiveServer, live_server, tiny_model

import kvstrata

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
DOCUMENTED_URL = "http://127.0.0.1:8000"
_BLOCK = re.compile(r"(?:<!-- run: (?P<mode>[a-z]+)[^>]*-->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.DOTALL)
_MODEL_ARG = re.compile(r"""model\s*=\s*(["'])[^"']+\1""")


def blocks() -> list[tuple[str | None, str, str]]:
    return [(m["mode"], m["lang"], m["code"]) for m in _BLOCK.finditer(DOC.read_text())]


SERVER_BLOCKS = [code for mode, _, code in blocks() if mode == "server"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("docs-agents")
    with live_server(tiny_model(root), root, max_prompt_tokens=8000) as srv:
        yield srv


def test_every_block_says_how_it_runs() -> None:
    found = blocks()
    assert [lang for mode, lang, _ in found if mode is None] in ([], ["text"])  # only the call format
    assert len(SERVER_BLOCKS) >= 5


@pytest.mark.parametrize("code", SERVER_BLOCKS, ids=[f"block{i}" for i in range(len(SERVER_BLOCKS))])
def test_server_block_runs(code: str, server: LiveServer, tmp_path: Path) -> None:
    script = _MODEL_ARG.sub(f'model="{MODEL_NAME}"', code.replace(DOCUMENTED_URL, server.url))
    (tmp_path / "example.py").write_text(script)
    src = str(Path(kvstrata.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (
        f"{script}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )
