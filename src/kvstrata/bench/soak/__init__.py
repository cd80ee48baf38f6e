"""``kvstrata bench soak``: hours of agents through ``kvstrata serve``, with restarts, kill -9 and gc,
watching RSS, files, threads, disk and TTFT for growth.

``runner`` holds the suite's typer ``command`` and its ``run(...)``; the other modules of this
package are its parts. Importing this package imports none of them."""
