"""Per-request plumbing shared by the routers: the server context, the caller's tenant, and
running store work in a worker thread under the context's lock."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from kvstrata.runtime import teamless
from kvstrata.server.auth import Denied, KeyGrant
from kvstrata.server.context import ServerContext
from kvstrata.server.errors import APIError

T = TypeVar("T")


def context(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


def client_address(request: Request) -> str | None:
    return f"{request.client.host}:{request.client.port}" if request.client else None


def authorize(request: Request) -> None:
    """Every route's check (the app's dependency): the caller's key must allow this request by
    the rule of :func:`kvstrata.server.auth.access_for`; a missing or unknown key is a 401, a key
    without the scope a 403, both audited. The grant is kept on the request for the route."""
    ctx = context(request)
    keys = ctx.config.api_keys
    authorization = request.headers.get("authorization")
    try:
        request.state.grant = keys.authorize(authorization, request.method, request.url.path)
    except Denied as exc:
        if ctx.audit is not None:
            if exc.status == 401:
                action, tenant = "auth_failure", None
                reason = "missing key" if authorization is None else "bad key"
            else:
                action, tenant, reason = "scope_denied", keys.tenant_for(authorization), str(exc)
            ctx.audit.record(
                action,
                tenant=tenant,
                client=client_address(request),
                outcome="denied",
                path=request.url.path,
                reason=reason,
            )
        raise APIError(exc.status, str(exc), type=_ERROR_TYPES[exc.status], code=exc.code) from None


_ERROR_TYPES = {401: "invalid_request_error", 403: "permission_error"}


def require_tenant(request: Request) -> str:
    """The caller's tenant (namespace), as :func:`authorize` found it for this tenant route."""
    grant: KeyGrant | None = getattr(request.state, "grant", None)
    if grant is None or grant.tenant is None:  # authorize lets no such request through
        raise APIError(401, "missing or invalid API key (Authorization: Bearer KEY)", code="invalid_api_key")
    return grant.tenant


async def locked(ctx: ServerContext, work: Callable[[], T]) -> T:
    """Run ``work`` in a worker thread while holding the store lock (the event loop stays free),
    its torch work on that thread alone (``runtime.teamless``: an OpenMP team there would throttle
    every step of the engine's for as long as the thread lives)."""

    def run() -> T:
        with ctx.store_lock, teamless():
            return work()

    return await run_in_threadpool(run)
