"""``kvstrata bench reopen``: how long a store holding many sessions takes to reopen.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
