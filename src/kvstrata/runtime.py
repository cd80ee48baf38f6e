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

import gc

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
