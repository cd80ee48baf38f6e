"""``kvstrata bench``: measurement suites, each comparing kvstrata side by side with a baseline in
one run (restore, agents, peers, trace, decode-overhead). Each suite module exposes ``run(...)``
returning a :class:`~kvstrata.bench.report.BenchResult`, and the CLI prints it as rich tables,
JSON, and writes a PNG plot."""
