"""``kvstrata bench pool``: what holding an agent's blocks encoded in device memory costs in speed.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; ``rows`` builds the rows it
times. Importing this package imports none of them."""
