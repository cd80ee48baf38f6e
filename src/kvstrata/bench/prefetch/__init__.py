"""``kvstrata bench prefetch``: a hinted agent's time to first token while another decodes.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
