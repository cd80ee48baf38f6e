"""``kvstrata bench redis``: block gets from the Redis tier (L4) against redis-benchmark.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
