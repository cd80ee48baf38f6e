"""``kvstrata bench``: the measurement suites, each comparing kvstrata side by side with a baseline
in one run. Every benchmark of the project lives here, as a suite.

Each suite is a package of its own (:data:`SUITES`): its ``runner`` module holds a typer
``command`` (registered by ``kvstrata.cli.bench_cmd``) and a ``run(...)`` returning a
:class:`~kvstrata.bench.common.result.BenchResult`, which the command shows as rich tables or
``--json``, with a PNG plot; a suite's report (tables, plot) sits beside its runner. What the
suites share lives in :mod:`kvstrata.bench.common`; a suite never imports another suite.

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
    "soak": "soak",
    "fuzz": "fuzz",
    "crash": "crash",
    "arrivals": "arrivals",
    "pool": "pool",
    "upgrade": "upgrade",
}
"""``kvstrata bench <name>`` -> its package in this package (the command is in its ``runner``)."""


def suite_modules() -> dict[str, ModuleType]:
    """Every suite's runner module, imported (cheap: heavy imports stay inside the suites' functions)."""
    return {name: importlib.import_module(f"{__name__}.{package}.runner") for name, package in SUITES.items()}
