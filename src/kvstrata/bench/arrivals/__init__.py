"""``kvstrata bench arrivals``: agents that arrive together with one system prompt compute it once.

``runner`` holds the suite's typer ``command`` and its ``run(...)``. Importing this package imports
nothing else."""
