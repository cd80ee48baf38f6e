"""What a newcomer sees when installing and cleaning up: no deprecation banners, no alarming
resolver errors, and `make clean` leaving nothing of ours behind."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_license_is_an_spdx_string_without_deprecation_warnings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `project.license` table makes setuptools print a deprecation banner on every install."""
    setuptools_pyproject = pytest.importorskip("setuptools.config.pyprojecttoml")
    from setuptools.dist import Distribution

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["license"] == "Apache-2.0"
    # SPDX strings need setuptools >= 77 (PEP 639); the build must not pick an older one
    (requirement,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", requirement)
    assert match and int(match[1]) >= 77, requirement
    monkeypatch.chdir(ROOT)  # the configuration names README.md relative to the project
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = setuptools_pyproject.apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_removes_both_venvs_and_the_caches(tmp_path: Path) -> None:
    made = [".venv", ".venv-vllm", ".pytest_cache", ".ruff_cache"]
    for name in made:
        (tmp_path / name / "bin").mkdir(parents=True)
    # in a scratch directory: the paths are relative, so this never touches the project's own venvs
    subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "clean"], cwd=tmp_path, check=True, timeout=60
    )
    assert [name for name in made if (tmp_path / name).exists()] == []


def test_the_vllm_venv_script_installs_kvstrata_last_and_says_why_it_has_no_deps() -> None:
    """pip checks the environment after every install that resolves dependencies and prints a
    resolver ERROR for any installed package whose requirements are unmet. kvstrata's transformers
    requirement is unmet beside vLLM's pin, by design: so kvstrata must be out of the environment
    while its runtime deps are installed, then go in last with --no-deps (which skips the check)."""
    lines = [line.strip() for line in (ROOT / "scripts" / "make_vllm_venv.sh").read_text().splitlines()]
    # pip_install: the script's wrapper (retried on a cut-off download) for "$PY" -m pip install
    lines = [re.sub(r"^pip_install ", '"$PY" -m pip install ', line) for line in lines]
    pip = [(n, line) for n, line in enumerate(lines) if re.search(r"-m pip (install|uninstall)", line)]
    kvstrata_install = [n for n, line in pip if "install -q --no-deps -e ." in line]
    uninstall = [n for n, line in pip if re.search(r"pip uninstall .*\bkvstrata\b", line)]
    installs_with_deps = [n for n, line in pip if " install " in line and "--no-deps" not in line]
    assert len(kvstrata_install) == 1 and len(uninstall) == 1
    assert uninstall[0] < min(n for n in installs_with_deps if n > uninstall[0])
    assert max(installs_with_deps) < kvstrata_install[0], "an install after kvstrata's re-checks it"
    assert any(line.startswith("echo") and "--no-deps" in line for line in lines[kvstrata_install[0] :])


def test_every_native_source_ships_in_the_wheel() -> None:
    """The native helpers compile their C/C++ source on the user's machine: each one must be
    package data, or an installed kvstrata falls back to torch for good ("its source is missing")."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    src = ROOT / "src"
    sources = [p for pattern in ("*.c", "*.cpp") for p in (src / "kvstrata").rglob(pattern)]
    assert sources
    for source in sources:
        package = ".".join(source.parent.relative_to(src).parts)
        patterns = package_data.get(package, [])
        assert any(source.match(pattern) for pattern in patterns), f"{source} is not in package-data"
