"""``kvstrata bench memory-modes``: lossy memory modes at run time.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
