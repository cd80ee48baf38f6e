"""``kvstrata bench server-load``: concurrent clients over many sessions through kvstrata serve.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
