"""``kvstrata bench agents``: many agents in one memory budget, kvstrata against fixed buffers.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
