"""The app factory: one FastAPI app over one engine (and its store)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstrata.engine import Engine
from kvstrata.server import admin, admin_api, openai_api
from kvstrata.server.audit import AuditLog
from kvstrata.server.context import ServerConfig, ServerContext
from kvstrata.server.deps import authorize, context
from kvstrata.server.errors import HANDLERS
from kvstrata.server.metrics import ServerMetrics


def create_app(
    engine: Engine, config: ServerConfig | None = None, *, on_shutdown: Callable[[], None] | None = None
) -> FastAPI:
    """The app serving ``engine``. The caller owns the engine and its store; ``on_shutdown`` runs
    when the server stops (a SIGTERM included: uvicorn re-raises the signal after the lifespan
    ends, so code after ``uvicorn.run`` would never run). The app closes its audit log."""
    config = config or ServerConfig()
    ctx = ServerContext(
        engine,
        config,
        AuditLog(config.audit_path) if config.audit_path is not None else None,
        ServerMetrics(engine),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
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
