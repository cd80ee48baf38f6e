"""Session admin routes: list, show, create, delete, fork, pin, unpin, priority, hibernate, export,
import.

Every route acts in the caller's namespace only: another tenant's session id is a 404 here, the
same as an id that does not exist. Actions that change or copy a session are audited.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from kvstrata.errors import KVStrataError, SessionBusyError
from kvstrata.priority import Priority
from kvstrata.server.context import ServerContext
from kvstrata.server.deps import client_address, context, locked, require_tenant
from kvstrata.server.errors import APIError, from_kvstrata
from kvstrata.server.schemas import CreateSessionRequest, ForkRequest, PriorityRequest
from kvstrata.store.sessions import SessionInfo

router = APIRouter(prefix="/v1/sessions")

T = TypeVar("T")


def _info(info: SessionInfo) -> dict[str, Any]:
    return {"object": "session", **dataclasses.asdict(info)}


async def _audited(
    request: Request, tenant: str, action: str, session_id: str | None, work: Callable[[ServerContext], T]
) -> T:
    """Run ``work`` under the store lock, and audit the action with its outcome."""
    ctx = context(request)
    outcome = "ok"
    try:
        return await locked(ctx, lambda: work(ctx))
    except APIError as exc:
        outcome = exc.code or str(exc.status)
        raise
    except KVStrataError as exc:
        error = from_kvstrata(exc)
        outcome = error.code or str(error.status)
        raise error from exc
    finally:
        if ctx.audit is not None:
            ctx.audit.record(
                action, tenant=tenant, client=client_address(request), session=session_id, outcome=outcome
            )


async def _plain(request: Request, work: Callable[[ServerContext], T]) -> T:
    ctx = context(request)
    try:
        return await locked(ctx, lambda: work(ctx))
    except KVStrataError as exc:
        raise from_kvstrata(exc) from exc


@router.get("")
async def list_sessions(request: Request, tenant: str = Depends(require_tenant)) -> dict[str, Any]:
    infos = await _plain(request, lambda ctx: ctx.store.list_sessions(tenant))
    return {"object": "list", "data": [_info(i) for i in infos]}


@router.post("", status_code=201)
async def create_session(
    body: CreateSessionRequest, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    def work(ctx: ServerContext) -> SessionInfo:
        session = ctx.store.create_session(
            body.id,
            tenant,
            priority=Priority.parse(body.priority or Priority.INTERACTIVE),
            ttl_s=body.ttl_s,
            pinned=body.pinned,
        )
        return session.info()

    return _info(await _audited(request, tenant, "create", body.id, work))


@router.post("/import", status_code=201)
async def import_session(
    request: Request,
    tenant: str = Depends(require_tenant),
    new_id: str | None = Query(default=None, alias="id"),
) -> dict[str, Any]:
    ctx = context(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > ctx.config.max_archive_bytes:
        raise APIError(413, "the archive is larger than this server accepts", code="archive_too_large")
    data = await request.body()
    if len(data) > ctx.config.max_archive_bytes:
        raise APIError(413, "the archive is larger than this server accepts", code="archive_too_large")

    def work(ctx: ServerContext) -> SessionInfo:
        return ctx.store.archives.import_session(data, new_id=new_id, namespace=tenant).info()

    return _info(await _audited(request, tenant, "import", new_id, work))


@router.get("/{session_id}")
async def show_session(
    session_id: str, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    return _info(await _plain(request, lambda ctx: ctx.store.session(session_id, tenant).info()))


@router.delete("/{session_id}")
async def delete_session(
    session_id: str, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    def work(ctx: ServerContext) -> None:
        ctx.store.session(session_id, tenant)  # a 404 for an unknown id
        if ctx.engine.busy(session_id, tenant):
            raise SessionBusyError(f"session {session_id} has a request running; delete it after")
        ctx.store.delete_session(session_id, tenant)
        ctx.engine.forget(session_id, tenant)

    await _audited(request, tenant, "delete", session_id, work)
    return {"object": "session.deleted", "id": session_id, "deleted": True}


@router.post("/{session_id}/fork", status_code=201)
async def fork_session(
    session_id: str, body: ForkRequest, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    def work(ctx: ServerContext) -> SessionInfo:
        return ctx.store.fork(ctx.store.session(session_id, tenant), body.id).info()

    return _info(await _audited(request, tenant, "fork", session_id, work))


def _set_pinned(session_id: str, tenant: str, pinned: bool) -> Callable[[ServerContext], SessionInfo]:
    def work(ctx: ServerContext) -> SessionInfo:
        session = ctx.store.session(session_id, tenant)
        session.pinned = pinned
        ctx.store.checkpoint(session)  # commits the flag with the session's row
        return session.info()

    return work


@router.post("/{session_id}/pin")
async def pin_session(
    session_id: str, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    return _info(await _audited(request, tenant, "pin", session_id, _set_pinned(session_id, tenant, True)))


@router.post("/{session_id}/unpin")
async def unpin_session(
    session_id: str, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    return _info(await _audited(request, tenant, "unpin", session_id, _set_pinned(session_id, tenant, False)))


@router.post("/{session_id}/priority")
async def set_session_priority(
    session_id: str, body: PriorityRequest, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    """The session's class, changed now; raised, its lossy blocks are made exact before its next
    request (from L3's exact copies at once, the others recomputed in idle engine steps)."""

    def work(ctx: ServerContext) -> dict[str, Any]:
        # an unknown class (400) or session (404) is refused before anything changes
        change = ctx.engine.set_priority(session_id, Priority.parse(body.priority), tenant)
        info = _info(ctx.store.session(session_id, tenant).info())
        upgrade = {
            "made_exact": change.made_exact,
            "recomputing": change.left_lossy if change.recompute else 0,
        }
        return {**info, "upgrade": upgrade}

    return await _audited(request, tenant, "priority", session_id, work)


@router.post("/{session_id}/hibernate")
async def hibernate_session(
    session_id: str, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    def work(ctx: ServerContext) -> dict[str, Any]:
        session = ctx.store.session(session_id, tenant)
        ctx.store.checkpoint(session)  # every block durable in L3 first
        keys = session.all_keys()
        ctx.store.blocks.demote_from_l1(keys)
        return {
            "object": "session.hibernated",
            "id": session_id,
            "num_tokens": session.num_tokens,
            "blocks": len(keys),
            "actions": [
                "checkpointed: every block is on disk (L3) and the session row is committed",
                "queued every block for demotion out of device memory (L1); blocks in use stay",
            ],
        }

    return await _audited(request, tenant, "hibernate", session_id, work)


@router.get("/{session_id}/export")
async def export_session(
    session_id: str, request: Request, tenant: str = Depends(require_tenant)
) -> Response:
    def work(ctx: ServerContext) -> bytes:
        return ctx.store.archives.export_session(ctx.store.session(session_id, tenant))

    data = await _audited(request, tenant, "export", session_id, work)
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{session_id}.kvsarc"'},
    )
