"""The fuzzer of the store's files (issue 30, acceptance 6), at a modest count: 0 wrong KV, token ids
or documents served and 0 raw exceptions, through the API on both L3 read paths and through the
commands. The long run is ``kvstrata bench fuzz --trials 100000``."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvstrata.bench.fuzz import mutations
from kvstrata.bench.fuzz.runner import one_trial
from kvstrata.bench.fuzz.template import KEY, Template, build
from kvstrata.cli.main import app


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Template]]:
    base = tmp_path_factory.mktemp("fuzz")
    yield [build(base / "plain", None), build(base / "sealed", KEY)]


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), cli=st.booleans())
def test_damaged_stores_serve_nothing_wrong_and_raise_nothing_raw(
    templates: list[Template], tmp_path_factory: pytest.TempPathFactory, seed: int, cli: bool
) -> None:
    group = typer.main.get_command(app) if cli else None
    outcome = one_trial(templates, tmp_path_factory.mktemp("trial"), seed, cli=group)
    assert not outcome.wrong, f"seed {seed}: {outcome.wrong} [{outcome.describe()}]"
    assert not outcome.raw, f"seed {seed}: {outcome.raw} [{outcome.describe()}]"


def test_every_mutation_changes_the_store(templates: list[Template], tmp_path: Path) -> None:
    """Each kind of damage does damage (a fuzzer whose mutations were no-ops would pass anything)."""
    from kvstrata.bench.fuzz.template import copy

    for name, mutate in mutations.MUTATIONS.items():
        root = tmp_path / name
        copy(templates[0], root)
        before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        what = mutate(root, random.Random(1), templates[1].root)
        after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        assert after != before, f"{name} changed nothing: {what}"


def test_the_bench_command(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "fuzz", "--trials", "4", "--cli-every", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["data"]
    assert data["trials"] == 4 and data["totals"]["loads"] > 0
    assert data["totals"]["wrong"] == 0 and data["totals"]["raw"] == 0


def test_mutations_apply_over_earlier_damage(templates: list[Template], tmp_path: Path) -> None:
    """Combined mutations: each one runs (or says why it cannot) over a store whose index an
    earlier one made unreadable or removed."""
    from kvstrata.bench.fuzz.template import copy
    from kvstrata.bench.fuzz.trial import apply

    for first in ("zero_index_page", "foreign_index", "remove_file", "truncate"):
        for name in mutations.MUTATIONS:
            root = tmp_path / f"{first}-{name}"
            copy(templates[0], root)
            with (root / "index.sqlite").open("r+b") as f:
                f.write(bytes(100))  # the header: "file is not a database"
            done = apply([first, name], root, random.Random(3), templates[1].root)
            assert len(done) == 2
