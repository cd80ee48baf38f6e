"""``kvstrata bench gpu-restore``: kvstrata's restore into GPU memory against a plain pinned copy.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
