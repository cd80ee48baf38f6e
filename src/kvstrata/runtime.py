"""Process-wide settings for a long-running kvstrata process (a server, a benchmark).

Python's cyclic garbage collector walks every tracked object of the heap in a full (generation 2)
collection. A process that has imported torch and transformers and loaded a model holds a few
hundred thousand such objects, so a full collection stops every thread for about 100 ms on this
machine (measured: 107 ms for 220,000 objects), and a restore or a decode step it lands in takes
that much longer. :func:`freeze_startup_heap` moves what start-up created into the collector's
permanent generation (``gc.freeze``, as vLLM's engine does after its start-up): those objects live
as long as the process anyway, and later full collections walk only what was made since (10 ms).
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

_frozen = False


def freeze_startup_heap() -> None:
    """Collect once, then leave everything alive now out of later collections (call once the
    model is loaded and the store is open, before serving). Once per process: objects made later
    stay collectable (a process that loads model after model keeps freeing the old ones)."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()


# -- OpenMP thread teams ------------------------------------------------------------------------
#
# torch's CPU operators run on OpenMP (GNU libgomp, bundled with torch). Each thread that starts a
# parallel region gets a team of worker threads of its own, and the team outlives the region: a
# model loaded on the main thread leaves the main thread's team behind, a store thread that copied
# a large tensor leaves its team. libgomp counts every team's workers, and once they outnumber the
# CPUs it stops spinning between regions ("throttled": about 100 spins, then sleep), so every one of
# the hundreds of parallel regions of a decode step starts by waking a sleeping worker. Measured on
# 2 cores (SmolLM2, fp32, 2026-11-30): a batched step of 8 rows took 94-100 ms on the thread that
# owned the only team, 108-124 ms on a second thread once the main thread had a team; the linear
# layers alone 41 against 48-55 ms; freeing the main thread's team (below) gave the 41 ms back.
# So kvstrata's background threads run their torch work without a team (single_threaded_torch),
# and the engine frees the team of the thread that built it (release_openmp_threads): the step
# thread's team is then the only one, as on the main thread of a script.


def _libgomp() -> Any:
    """torch's libgomp (the library instance already loaded), or None (another OpenMP, not Linux)."""
    global _gomp
    if _gomp is None:
        _gomp = False
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
            if len(paths) == 1:
                lib = ctypes.CDLL(paths.pop())
                if hasattr(lib, "omp_pause_resource_all") and hasattr(lib, "omp_set_num_threads"):
                    _gomp = lib
        except OSError:
            pass
    return _gomp or None


_gomp: Any = None


def release_openmp_threads() -> bool:
    """Let the OpenMP worker threads of the calling thread's team end (``omp_pause_resource_all``,
    hard); its next parallel region starts a new team. True if libgomp did it."""
    import torch  # noqa: F401  (libgomp is loaded with torch)

    lib = _libgomp()
    return bool(lib is not None and lib.omp_pause_resource_all(2) == 0)


def single_threaded_torch() -> None:
    """Run the calling thread's torch operators on that thread alone, with no OpenMP team, and
    leave every other thread's setting (and torch's default for new threads) as it is: the
    thread's own OpenMP setting is changed, not ``torch.set_num_threads``'s process-wide one."""
    import torch

    lib = _libgomp()
    if lib is None:
        return
    torch.get_num_threads()  # torch sets a thread's OpenMP threads on first use: let it do so now
    lib.omp_set_num_threads(1)
