"""``kvstrata bench``: the measurement suites, each comparing kvstrata side by side with a baseline
in one run. Every benchmark of the project lives here, as a suite.

Each suite module (:data:`SUITES`) holds a typer ``command`` (registered by
``kvstrata.cli.bench_cmd``) and a ``run(...)`` returning a :class:`~kvstrata.bench.report.BenchResult`,
which the command shows as rich tables or ``--json``, with a PNG plot. What the suites share:

- :mod:`.command` — the common options, errors as one line, showing a result;
- :mod:`.report` — ``BenchResult`` / ``BenchTable``, JSON and the plot;
- :mod:`.measure` — medians, GB/s, variant order, the cells' formats;
- :mod:`.models` — the model (SmolLM2, or the tiny random Llama), prompts, prefill;
- :mod:`.stores` — work directories, store configs, a session committed, a timed restore;
- :mod:`.hardware` — the raw baselines (cold reads, memcpy, write+fsync) and the page cache;
- :mod:`.servers` — a private ``redis-server`` and ``kvstrata serve`` in child processes;
- :mod:`.mooncake` — Mooncake's request traces as token ids.

``vllm_connector`` is not a ``kvstrata bench`` suite: it runs in vLLM's own virtual environment
(``python -m kvstrata.bench.vllm_connector``). Importing this package imports no suite.
"""

from __future__ import annotations

import importlib
from types import ModuleType

SUITES: dict[str, str] = {
    "restore": "restore",
    "agents": "agents",
    "peers": "peers",
    "trace": "trace",
    "decode-overhead": "decode_overhead",
    "gpu-restore": "gpu_restore",
    "reopen": "reopen",
    "prefetch": "prefetch",
    "burst": "burst",
    "hysteresis": "hysteresis",
    "memory-modes": "memory_modes",
    "redis": "redis_gets",
    "server-load": "server_load",
    "batching": "batching",
}
"""``kvstrata bench <name>`` -> its module in this package."""


def suite_modules() -> dict[str, ModuleType]:
    """Every suite's module, imported (cheap: heavy imports stay inside the suites' functions)."""
    return {name: importlib.import_module(f"{__name__}.{module}") for name, module in SUITES.items()}
