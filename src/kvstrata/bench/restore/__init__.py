"""``kvstrata bench restore``: resuming a session from each tier against recomputing it.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
