"""The app factory: one FastAPI app over one engine (and its store)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstrata.engine import DrainReport, Engine
from kvstrata.engine.drain import DEFAULT_DRAIN_TIMEOUT_S
from kvstrata.server import admin, admin_api, openai_api, responses_api, tokens
from kvstrata.server.audit import AuditLog
from kvstrata.server.context import ServerConfig, ServerContext
from kvstrata.server.deps import authorize, context
from kvstrata.server.errors import HANDLERS
from kvstrata.server.memwatch import MemWatch
from kvstrata.server.metrics import ServerMetrics

log = logging.getLogger("kvstrata.server")


def create_app(
    engine: Engine,
    config: ServerConfig | None = None,
    *,
    on_shutdown: Callable[[], None] | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> FastAPI:
    """The app serving ``engine``. The caller owns the engine and its store; ``on_shutdown`` runs
    when the server stops (a SIGTERM included: uvicorn re-raises the signal after the lifespan
    ends, so code after ``uvicorn.run`` would never run). The app closes its audit log.

    A stop drains (:meth:`Engine.drain`): from the first SIGTERM or SIGINT (or, with no signal,
    from the lifespan's end), no request is taken, the running ones have ``drain_timeout_s`` in
    all to finish and save their KV (cancelled, keeping what they computed, near the end), and
    what could not be saved in time is logged with a count; uvicorn meanwhile waits for their
    responses to end."""
    config = config or ServerConfig()
    ctx = ServerContext(
        engine,
        config,
        AuditLog(config.audit_path, key=engine.store.config.encryption_key) if config.audit_path else None,
        ServerMetrics(engine),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        draining: list[asyncio.Future[DrainReport]] = []

        def begin_drain() -> None:
            if not draining:
                draining.append(loop.run_in_executor(None, engine.drain, drain_timeout_s))

        _on_stop_signals(lambda: loop.call_soon_threadsafe(begin_drain))
        watch = MemWatch.from_env()  # opt-in: KVSTRATA_MEMWATCH=<file> (kvstrata.server.memwatch)
        if watch is not None:
            watch.start(loop)
        yield
        if watch is not None:
            watch.stop()
        begin_drain()
        report = await draining[0]
        # a cut or unsaved request is worth the operator's eye (uvicorn's log shows warnings)
        quiet = report.complete and not report.cancelled
        (log.info if quiet else log.warning)("%s", report.describe(drain_timeout_s))
        if ctx.audit is not None:
            ctx.audit.close()
        if on_shutdown is not None:
            on_shutdown()

    # every route, those added later included, is checked by one rule (kvstrata.server.auth)
    app = FastAPI(
        title="kvstrata", lifespan=lifespan, exception_handlers=HANDLERS, dependencies=[Depends(authorize)]
    )
    app.state.ctx = ctx
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(tokens.router)
    app.include_router(admin.router)
    app.include_router(admin_api.router)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_name}

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        # sync: a scrape reads the index and tier figures, off the event loop
        return Response(generate_latest(context(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _on_stop_signals(callback: Callable[[], None]) -> None:
    """Call ``callback`` on SIGTERM and SIGINT, then the server's own handler (uvicorn's, which
    starts its graceful shutdown, and puts the handlers it found back when it ends). Only where
    the server handles them in Python, on the main thread: elsewhere (a server run in a thread)
    the drain starts at the lifespan's end."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            callback()
            previous(signum, frame)

        signal.signal(sig, handler)
