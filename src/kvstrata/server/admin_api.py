"""Store-wide figures for an admin key (``/v1/admin/...``; the rule in :mod:`kvstrata.server.auth`
gives every route under this prefix to admin keys only): what ``kvstrata store stats`` prints,
over every tenant, and each tenant's bytes per tier."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request

from kvstrata.server.deps import context, locked

router = APIRouter(prefix="/v1/admin")


@router.get("/stats")
async def store_stats(request: Request) -> dict[str, Any]:
    ctx = context(request)

    def read() -> dict[str, Any]:
        store = ctx.store
        usage: dict[str, dict[str, int]] = {}
        for (namespace, level), nbytes in sorted(store.blocks.namespace_usage().items()):
            usage.setdefault(namespace, {})[level.name] = nbytes
        return {"object": "store.stats", **asdict(store.stats()), "namespaces": usage}

    return await locked(ctx, read)
