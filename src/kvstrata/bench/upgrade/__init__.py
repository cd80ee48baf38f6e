"""``kvstrata bench upgrade``: a background agent raised to realtime, its next turn timed.

``runner`` holds the suite's typer ``command`` and its ``run(...)``. Importing this package imports
nothing else."""
