"""Per-request plumbing shared by the routers: the server context, the caller's tenant, and
running store work in a worker thread under the context's lock."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from kvstrata.server.context import ServerContext
from kvstrata.server.errors import APIError

T = TypeVar("T")


def context(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


def client_address(request: Request) -> str | None:
    return f"{request.client.host}:{request.client.port}" if request.client else None


def require_tenant(request: Request) -> str:
    """The caller's tenant (namespace); a missing or unknown API key is a 401, and audited."""
    ctx = context(request)
    tenant = ctx.config.api_keys.tenant_for(request.headers.get("authorization"))
    if tenant is None:
        if ctx.audit is not None:
            ctx.audit.record(
                "auth_failure",
                tenant=None,
                client=client_address(request),
                outcome="denied",
                path=request.url.path,
                reason="missing key" if "authorization" not in request.headers else "bad key",
            )
        raise APIError(401, "missing or invalid API key (Authorization: Bearer KEY)", code="invalid_api_key")
    return tenant


async def locked(ctx: ServerContext, work: Callable[[], T]) -> T:
    """Run ``work`` in a worker thread while holding the store lock (the event loop stays free)."""

    def run() -> T:
        with ctx.store_lock:
            return work()

    return await run_in_threadpool(run)
