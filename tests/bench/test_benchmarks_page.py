"""docs/benchmarks.md stays a first page of current figures (issue 34, acceptance 7): at most 200
lines, a section with a goal table for every ``kvstrata bench`` suite, and each section's history
file present; the history files hold the runs."""

from __future__ import annotations

import re
from pathlib import Path

from kvstrata.bench import SUITES

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "benchmarks.md"
MAX_LINES = 200


def _sections() -> dict[str, str]:
    """``### <name>: ...`` heading -> the section's text."""
    parts = re.split(r"^### ", PAGE.read_text(), flags=re.M)[1:]
    return {part.split(":", 1)[0].strip(): part for part in parts}


def test_the_first_page_is_short() -> None:
    assert len(PAGE.read_text().splitlines()) <= MAX_LINES


def test_every_suite_has_a_section_with_its_command_a_goal_table_and_its_history() -> None:
    sections = _sections()
    for suite in SUITES:
        assert suite in sections, f"docs/benchmarks.md has no '### {suite}: ...' section"
        text = sections[suite]
        assert f"kvstrata bench {suite}" in text, f"the {suite} section does not give its command"
        assert "| goal | latest | met |" in text, f"the {suite} section has no goal table"
        assert f"(benchmarks/{suite}.md)" in text, f"the {suite} section does not link its history"


def test_every_linked_history_file_exists_and_links_back() -> None:
    linked = re.findall(r"\]\((benchmarks/[\w.-]+\.md)\)", PAGE.read_text())
    assert linked
    for name in linked:
        history = DOCS / name
        assert history.is_file(), f"{name} is linked from docs/benchmarks.md but missing"
        assert "](../benchmarks.md)" in history.read_text(), f"{name} does not link the first page"
    on_disk = {f"benchmarks/{p.name}" for p in (DOCS / "benchmarks").glob("*.md")}
    assert on_disk <= set(linked), f"history files not linked from the first page: {on_disk - set(linked)}"
