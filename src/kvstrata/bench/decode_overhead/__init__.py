"""``kvstrata bench decode-overhead``: per-token decode latency with kvstrata's cache.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
