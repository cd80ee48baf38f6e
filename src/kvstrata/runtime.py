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
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
#
# A thread that ends frees its team, and the next thread to run a parallel region builds one
# again. The engine's step thread and store worker used to end whenever they ran out of work, so a
# server answering one request at a time started both threads, and a team, for every request.

IDLE_THREAD_S = 30.0
"""How long the engine's step thread and store worker wait for more work before they end."""


def _libgomp() -> Any:
    """torch's libgomp (the library instance already loaded), or None (another OpenMP, not Linux).

    Looked up once, under a lock: the store's threads start together and each asks at once (a
    thread that asked while another was looking used to get None, and ran with a team of its own:
    every OpenMP region in the process then throttled, in some processes and not others)."""
    global _gomp
    with _gomp_lock:
        if _gomp is None:
            _gomp = _find_libgomp()
    return _gomp or None


def _find_libgomp() -> Any:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
        if len(paths) == 1:
            lib = ctypes.CDLL(paths.pop())
            if hasattr(lib, "omp_pause_resource_all") and hasattr(lib, "omp_set_num_threads"):
                return lib
    except OSError:
        pass
    return False


_gomp: Any = None
_gomp_lock = threading.Lock()


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


@contextmanager
def teamless() -> Iterator[None]:
    """Run the block's torch operators on the calling thread alone (no OpenMP team), then give
    the thread its setting back: for store work on a thread kvstrata does not own (a caller's
    ``delete_session`` copies a block: on the caller's thread that built a team, and every step
    of the engine then throttled, 15% slower, for the rest of the process)."""
    import torch

    lib = _libgomp()
    if lib is None:
        yield
        return
    torch.get_num_threads()
    threads = lib.omp_get_max_threads()
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(threads)


BACKGROUND_NICE = 10
"""The CPU priority (Linux nice value) of threads whose work may wait (:func:`background_thread`)."""


def lower_priority(native_id: int) -> bool:
    """Lower the CPU priority of the thread ``native_id`` to ``BACKGROUND_NICE`` (Linux sets it
    per thread; a priority already lower stays); False on another OS, or once the thread is gone."""
    import os

    try:
        current = os.getpriority(os.PRIO_PROCESS, native_id)
        os.setpriority(os.PRIO_PROCESS, native_id, max(current, BACKGROUND_NICE))
    except (AttributeError, OSError):
        return False
    return True


def background_thread() -> bool:
    """For a thread whose work may wait (re-encoding, demotion): :func:`single_threaded_torch`,
    and the calling thread's CPU priority lowered (:func:`lower_priority`), so that on a machine
    with few cores it yields them to the step thread's decode (the step then runs as fast as in a
    quiet process). True if the priority was lowered."""
    import threading

    single_threaded_torch()
    return lower_priority(threading.get_native_id())


# -- glibc's heap ---------------------------------------------------------------------------------
#
# A server frees most of what a request allocated (a step's activations and logits, a block's
# staging copy) on many threads, in sizes that vary with the prompt. By default glibc serves a
# chunk above its mmap threshold (128 KiB) with a mapping of its own, returned to the OS when
# freed, but it raises that threshold to the size of every such chunk freed (up to 32 MiB): after
# the first freed 1 MiB tensor, tensors of that size come from the arenas, between small chunks
# still in use, and their pages stay in RSS when freed. And each thread that allocates under
# contention gets an arena of its own (up to 8 per core), each keeping its own free memory.
# Measured with ``kvstrata bench soak --memwatch`` (tiny model, 12 agents, 2026-12-03): Python's
# allocations (tracemalloc) 3-6 MB, glibc's free bytes inside its arenas 30 -> 146 MB in 8 minutes,
# RSS +800 MB/h; ``malloc_trim`` every 30 s did not change the slope (the free memory lay in pages
# still partly used). :func:`tune_heap` then fixed the threshold and capped the arenas at two, as
# ``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_ARENA_MAX=2`` would: the same 8-minute soak, ~4,000
# requests each, grew 580 MB/h outside L1 and L2 against 915 before (19 against 31 MB per 1,000
# requests): less, not flat; the rest is not explained yet (docs/benchmarks/soak.md).
#
# A threshold of 128 KiB, though, gave every larger tensor a fresh mapping, faulted in and zeroed
# page by page on each allocation: a step's activations are that large (SmolLM2's MLP activations
# of 160 prompt tokens: 1 MB in fp32). Measured on the AMD EPYC VM (2026-12-05, SmolLM2 fp32, one
# thread, the serve benchmark's burst of 8 follow-up turns in process): the step of their 160 new
# prompt tokens took 600-718 ms with the 128 KiB threshold against 306-311 ms untuned, a decode
# step of 8 rows 57-62 against 47-49 ms; with a threshold of 1 MiB 345-362 and 50-54 ms, with 4
# MiB and 32 MiB about the same as 1 MiB. So the threshold is fixed at 4 MiB: a step's activations
# at the default step budget (512 tokens) come from the heap, large KV buffers still get mappings
# of their own. (That 128 KiB had cost kvstrata serve half its prefill speed: its 8-session TTFT
# was 761 ms against 330-460 in process.)
#
# One arena, not two. The main heap is where the model, torch and transformers were loaded; it
# keeps about 90 MB free once start-up is over (245 MiB resident for the tiny model, flat for
# hours). With two arenas, the request threads (engine step, store workers) allocated from a second
# arena beside it, which grew with their chunks still in use at its top while the main heap's free
# memory went unused: ``/proc/PID/smaps`` of the 2-hour soak of 2026-12-06 (tiny model, 12 agents):
# the second arena 18 -> 34 MiB resident in 48 minutes, the main heap flat, everything else flat but
# Python's arenas (+0 after 14 minutes), the whole RSS 593 -> 610 MiB (+7.8 MB/h over 15-60 min).
# Its second hour, after a restart with one arena: RSS 569.2 -> 569.4 MiB over 76-120 minutes
# (+0.09 MB/h), the main heap still 245.7 MiB, no second arena; a 2-hour soak with one arena
# throughout (09:35 UTC): +0.14 MB/h in its first start, flat in its second. Not slower: TTFT p50 21 ms
# in its quiet last 40 minutes against 31 in its first 30 (two arenas, light work beside it); the
# arena's lock is rarely contended (small chunks come from each thread's tcache without it, and
# the GIL serialises the Python threads). The serve benchmark has not been re-run since.

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 4 << 20
ARENA_MAX = 1


def tune_heap() -> bool:
    """Fix glibc's mmap threshold at 4 MiB and use one arena, each unless the environment
    sets it (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``: glibc's own reading of it stands).
    Call at the start of a long-running process, before its threads. False where not glibc."""
    import os

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = True
    settings = {"MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, MMAP_THRESHOLD)}
    settings["MALLOC_ARENA_MAX"] = (_M_ARENA_MAX, ARENA_MAX)
    for env, (param, value) in settings.items():
        if env not in os.environ:
            done = bool(mallopt(param, value)) and done
    return done
