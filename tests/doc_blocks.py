"""The fenced code blocks of README.md, docs/*.md and docs/benchmarks/*.md, and how each one runs.

The line right before a fence says how the block runs (tests/test_docs.py and
tests_vllm/test_docs_vllm.py run them):

    <!-- run: python -->            a Python script (on the tiny model: $KVSTRATA_MODEL)
    <!-- run: shell -->             a bash script (``kvstrata`` on PATH, the tiny model)
    <!-- run: server -->            a Python client run against a live ``kvstrata serve``
    <!-- run: vllm -->              run in .venv-vllm by tests_vllm
    <!-- run: skip (reason) -->     not run, and why

A block tagged ``bash``/``sh``/``python`` (or not tagged at all) without that line is an error, so
no example can rot unrun; sample output and file layouts are tagged ``text``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("python", "shell", "server", "vllm", "skip")
PYTHON_LANGS = frozenset({"python", "py", "python3"})
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
# The languages that look runnable; an untagged block counts (it is a command, or should say "text").
RUNNABLE_LANGS = PYTHON_LANGS | SHELL_LANGS | {""}
# The languages each mode runs.
MODE_LANGS = {
    "python": PYTHON_LANGS,
    "server": PYTHON_LANGS,
    "shell": SHELL_LANGS,
    "vllm": PYTHON_LANGS | SHELL_LANGS,
    "skip": RUNNABLE_LANGS,
}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)\s*$")
_RUN = re.compile(r"^\s*<!--\s*run:\s*(?P<mode>[\w-]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
_RUN_LOOSE = re.compile(r"^\s*<!--\s*run\b")


@dataclass(frozen=True)
class DocBlock:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mode: str | None  # None: no annotation
    reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    docs = ROOT / "docs"
    return [ROOT / "README.md", *sorted(docs.glob("*.md")), *sorted(docs.glob("benchmarks/*.md"))]


def parse(path: Path) -> tuple[list[DocBlock], list[str]]:
    """The blocks of one Markdown file, and the problems found while reading it (an annotation
    that is malformed or not right before a fence, a fence never closed)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT)
    blocks: list[DocBlock] = []
    problems: list[str] = []
    used_annotations: set[int] = set()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        if i == len(lines):
            problems.append(f"{rel}:{start + 1}: a fence that is never closed")
        mode = reason = None
        if start > 0 and (annotation := _RUN.match(lines[start - 1])):
            mode, reason = annotation["mode"], annotation["reason"]
            used_annotations.add(start - 1)
        blocks.append(
            DocBlock(path, start + 1, opening["lang"].lower(), "\n".join(body) + "\n", mode, reason)
        )
        i += 1
    for n, line in enumerate(lines):
        if _RUN_LOOSE.search(line) and n not in used_annotations:
            problems.append(f"{rel}:{n + 1}: a run annotation that is malformed or not right before a fence")
    return blocks, problems


def all_blocks() -> tuple[list[DocBlock], list[str]]:
    blocks: list[DocBlock] = []
    problems: list[str] = []
    for path in doc_files():
        found, wrong = parse(path)
        blocks += found
        problems += wrong
    return blocks, problems


def check(block: DocBlock) -> str | None:
    """What is wrong with a block's annotation, or None."""
    if block.mode is None:
        if block.lang in RUNNABLE_LANGS:
            shown = block.lang or "untagged"
            return (
                f"{block.id}: {shown} block without a <!-- run: python|shell|server|vllm|skip (reason) --> "
                "line right before it (sample output or a file layout: tag it ```text)"
            )
        return None
    if block.mode not in MODES:
        return f"{block.id}: unknown run mode {block.mode!r} (one of {', '.join(MODES)})"
    if block.lang not in MODE_LANGS[block.mode]:
        return f"{block.id}: {block.lang or 'untagged'} block cannot run as {block.mode}"
    if block.mode == "skip" and not (block.reason or "").strip():
        return f"{block.id}: run: skip needs a reason, e.g. <!-- run: skip (sample output) -->"
    if block.mode != "skip" and block.reason:
        return f"{block.id}: only skip takes a reason"
    for named in re.findall(r"\b(?:tests|tests_vllm|scripts|benchmarks)/[\w/.-]*\w", block.reason or ""):
        if not (ROOT / named).exists():
            return f"{block.id}: the skip reason names {named}, which does not exist"
    return None


def blocks_of(mode: str) -> list[DocBlock]:
    return [block for block in all_blocks()[0] if block.mode == mode]
