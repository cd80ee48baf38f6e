"""``kvstrata bench peers``: resuming a session, kvstrata against llama.cpp's state save/restore.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
