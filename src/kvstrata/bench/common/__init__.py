"""What the bench suites share (each suite's package imports from here, never from another suite):

- :mod:`.command` — the common options, errors as one line, showing a result;
- :mod:`.result` — ``BenchResult`` / ``BenchTable``, JSON and the plot;
- :mod:`.measure` — medians, GB/s, variant order, the cells' formats;
- :mod:`.models` — the model (SmolLM2, or the tiny random Llama), prompts, prefill;
- :mod:`.stores` — work directories, store configs, a session committed, a timed restore;
- :mod:`.hardware` — the raw baselines (cold reads, memcpy, write+fsync) and the page cache;
- :mod:`.servers` — a private ``redis-server`` and ``kvstrata serve`` in child processes.
"""
