"""``kvstrata bench burst``: a burst of background wake-ups must not delay a realtime agent.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
