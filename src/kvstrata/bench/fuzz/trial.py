"""One fuzz trial: a copy of a template store, damaged, then used through the public API and the
command line, and held to the template's reference.

What counts:

- **wrong**: token ids that differ from the reference, KV that differs from it by one bit, or a
  document's bytes that differ (a served session may be shorter: a missing block is recomputed);
- **raw**: any exception that is not a :class:`~kvstrata.errors.KVStrataError` (API), or a
  command that ended in a traceback or with an error of more than one line (CLI);
- everything else is fine: served whole, served in part, or refused with a kvstrata error.
"""

from __future__ import annotations

import random
import sqlite3
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench.common.hardware import drop_store_page_cache
from kvstrata.bench.fuzz import mutations
from kvstrata.bench.fuzz.template import DOCUMENT, MODEL, Template, copy
from kvstrata.errors import KVStrataError
from kvstrata.store import KVStore


@dataclass
class Outcome:
    mutations: list[str] = field(default_factory=list)
    direct_reads: bool = False
    loads: int = 0
    whole: int = 0
    partial: int = 0
    refused: int = 0
    wrong: list[str] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    cli_runs: int = 0

    def describe(self) -> str:
        return "; ".join(self.mutations) + f" ({'direct' if self.direct_reads else 'page cache'} reads)"


def run_trial(
    template: Template, other: Template, workdir: Path, rng: random.Random, *, cli: Any | None
) -> Outcome:
    """One trial in ``workdir`` (replaced): 1-3 mutations, then the API (and, given ``cli``, the
    ``kvstrata`` command group, the commands); ``rng`` decides everything, so a trial is replayed
    from its seed."""
    trial = copy(template, workdir / "store")
    outcome = Outcome(direct_reads=rng.random() < 0.5)
    outcome.mutations = apply(mutations.pick(rng, rng.choice((1, 1, 2, 3))), trial.root, rng, other.root)
    if outcome.direct_reads:
        drop_store_page_cache(trial.root)  # so that the direct path is the one taken
    _guard(outcome, "API", lambda: _use_store(trial, outcome))
    if cli is not None:
        _use_commands(cli, trial, outcome, rng)
        _guard(outcome, "API after the commands", lambda: _use_store(trial, outcome))
    return outcome


def apply(names: list[str], root: Path, rng: random.Random, other: Path) -> list[str]:
    """Apply the mutations ``names`` in turn; what each did (or why it could not: an earlier one
    may have left nothing to damage that way, a file gone or an index SQLite cannot open)."""
    done = []
    for name in names:
        try:
            done.append(f"{name}: {mutations.MUTATIONS[name](root, rng, other)}")
        except (OSError, IndexError, ValueError, sqlite3.Error) as exc:
            done.append(f"{name}: not made ({exc})")
    return done


def _guard(outcome: Outcome, where: str, work: Callable[[], None]) -> None:
    try:
        work()
    except KVStrataError:
        outcome.refused += 1
    except Exception as exc:  # what the fuzzer is looking for: counted, with where it came from
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        outcome.raw.append(f"{where}: {type(exc).__name__}: {exc} at {frame.filename}:{frame.lineno}")


def _use_store(trial: Template, outcome: Outcome) -> None:
    config = trial.config(direct_reads=outcome.direct_reads)
    store = KVStore(trial.root, model_fingerprint=MODEL, config=config)
    try:
        store.list_sessions()
        store.stats()
        for name, expected in trial.sessions.items():
            _guard(outcome, f"session {name}", partial(_check_session, store, name, expected, outcome))
    finally:
        store.close()


def _check_session(store: KVStore, name: str, expected: Any, outcome: Outcome) -> None:
    outcome.loads += 1
    session = store.session(name)
    if list(session.token_ids) != expected.token_ids:
        outcome.wrong.append(f"{name}: token ids differ from the reference")
        return
    document = store.documents.get(name, DOCUMENT)
    if document is not None and document != expected.document:
        outcome.wrong.append(f"{name}: document differs from the reference")
    loaded = store.load(session)
    n = loaded.num_tokens
    if n and (loaded.kv is None or not _same_bits(loaded.kv, expected.kv[:, :, :, :n])):
        outcome.wrong.append(f"{name}: KV of its first {n} tokens differs from the reference")
        return
    if n == len(expected.token_ids):
        outcome.whole += 1
    else:
        outcome.partial += 1


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )


def _use_commands(group: Any, trial: Template, outcome: Outcome, rng: random.Random) -> None:
    env = {"KVSTRATA_ENCRYPTION_KEY": trial.key.hex()} if trial.key is not None else {}
    files = [*mutations.data_files(trial.root), trial.root / "index.sqlite"]
    commands = [
        ["sessions", "list", "--store", str(trial.root)],
        ["store", "stats", "--store", str(trial.root)],
        ["sessions", "show", rng.choice(sorted(trial.sessions)), "--store", str(trial.root)],
        ["inspect", str(rng.choice(files))],
        ["gc", "--store", str(trial.root)],
    ]
    for args in commands:
        outcome.cli_runs += 1
        code, out, err, exc = invoke(group, args, env)
        if exc is not None:
            outcome.raw.append(f"kvstrata {' '.join(args[:2])}: {type(exc).__name__}: {exc}")
            continue
        errors = [line for line in err.splitlines() if line.strip()]
        # one line for an error; inspect names each damaged record of a segment on a line of its own
        lines_ok = len(errors) == 1 or (
            args[0] == "inspect" and all(e.startswith("corrupt:") for e in errors)
        )
        if code not in (0, 1) or "Traceback" in out + err or (code and not lines_ok):
            outcome.raw.append(f"kvstrata {' '.join(args[:2])}: exit {code}, stderr {err[-300:]!r}")


def invoke(group: Any, args: list[str], env: dict[str, str]) -> tuple[int, str, str, Exception | None]:
    """Run the ``kvstrata`` command ``group`` (a click group) with ``args`` in this process, as a
    user's shell would: (exit status, stdout, stderr, an exception that escaped it)."""
    from typer.testing import CliRunner

    with CliRunner().isolation(env=env) as (out, err, _):
        escaped: Exception | None = None
        try:
            group.main(args=args, prog_name="kvstrata")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except Exception as exc:  # what the fuzzer is looking for
            code, escaped = 1, exc
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace"), escaped
