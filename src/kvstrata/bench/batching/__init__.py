"""``kvstrata bench batching``: continuous batching's decode throughput against serial decoding.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
