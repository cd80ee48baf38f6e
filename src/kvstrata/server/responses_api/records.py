"""Stored responses, kept as documents of the session whose KV holds their conversation.

A stored response is the session document ``response:<id>``: the response object as
``GET /v1/responses/{id}`` returns it, and the items the model saw before its output (the
chain's history and the request's input, without the instructions). The session's document
``responses:head`` names the response its tokens end with. The documents live and die with the
session (:mod:`kvstrata.store.documents`): a fork copies them, deleting the session (by hand, by
its TTL or by ``gc``) deletes them, an export carries them, an encrypted store seals them, and a
restarted server finds them again.

A chain of responses is one session (:func:`place`): a request with no ``previous_response_id``
starts a session of its own (named by the request, or ``resp_<id>`` with the server's response
TTL); one that continues the latest response of a session runs in that session, sending only its
new input and reusing all of the KV; one that continues an older response forks the session
(blocks shared copy-on-write) and runs in the fork, whose tokens then diverge where the old
response ended. Tenants only ever look in their own namespace, so another tenant's response id
is "not found", like an id that never existed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvstrata.errors import ConfigError, CorruptBlockError
from kvstrata.server.context import ServerContext
from kvstrata.server.errors import APIError
from kvstrata.server.responses_api.items import Item
from kvstrata.server.responses_api.schemas import MAX_ID_CHARS

FORMAT = 1
HEAD = "responses:head"


def document_name(response_id: str) -> str:
    return f"response:{response_id}"


@dataclass(frozen=True, slots=True)
class Record:
    """One stored response: where it lives, the object, and the items before its output."""

    session_id: str
    response: dict[str, Any]
    context: list[Item]

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def history(self) -> list[Item]:
        """The conversation a continuation of this response extends: its context and output."""
        return [*self.context, *self.response["output"]]

    def encode(self) -> bytes:
        return json.dumps(
            {"format": FORMAT, "response": self.response, "context": self.context}, ensure_ascii=False
        ).encode()

    @classmethod
    def decode(cls, session_id: str, data: bytes) -> Record:
        try:
            value = json.loads(data)
            if value.get("format") != FORMAT:
                raise ValueError(f"format {value.get('format')!r}, expected {FORMAT}")
            return cls(session_id, dict(value["response"]), list(value["context"]))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptBlockError(
                f"stored response in session {session_id!r} is unreadable: {exc}"
            ) from exc


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"no response with id {response_id!r}",
        param=param,
        type="invalid_request_error",
        code="response_not_found",
    )


def find(ctx: ServerContext, namespace: str, response_id: str) -> Record | None:
    """The stored response ``response_id`` of ``namespace`` (call under the store lock)."""
    if not response_id or len(response_id) > MAX_ID_CHARS:
        return None
    found = ctx.store.documents.find(document_name(response_id), namespace=namespace)
    return Record.decode(*found) if found is not None else None


def save(ctx: ServerContext, namespace: str, record: Record) -> None:
    """Store ``record`` in its session and make it the session's head (call under the store lock)."""
    documents = ctx.store.documents
    documents.put(record.session_id, document_name(record.id), record.encode(), namespace=namespace)
    documents.put(record.session_id, HEAD, record.id.encode(), namespace=namespace)


def delete(ctx: ServerContext, namespace: str, response_id: str) -> bool:
    """Delete the response, and the copies forks of its session inherited (call under the lock)."""
    name = document_name(response_id)
    deleted = False
    while (found := ctx.store.documents.find(name, namespace=namespace)) is not None:
        ctx.store.documents.delete(found[0], name, namespace=namespace)
        deleted = True
    return deleted


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs: its session (None: a throwaway one), and how that session comes to be."""

    session_id: str | None
    fork_from: str | None = None
    """A session to fork into ``session_id`` first (the previous response is not its latest)."""
    new_chain: bool = False
    """``session_id`` is made for this chain, with the server's response TTL."""


def place(
    ctx: ServerContext,
    namespace: str,
    previous: Record | None,
    named: str | None,
    *,
    store: bool,
    response_id: str,
) -> Placement:
    """The session of a request: ``previous`` is the response it continues, ``named`` the session
    its request names (``X-Session-Id``, ``prompt_cache_key``); call under the store lock."""
    if previous is None:
        if named is not None:
            return Placement(named)
        return Placement(response_id, new_chain=True) if store else Placement(None)
    if named is not None and named != previous.session_id:
        raise APIError(
            400,
            f"previous_response_id {previous.id!r} belongs to session {previous.session_id!r}, "
            f"not to the session {named!r} the request names",
            param="previous_response_id",
            code="invalid_value",
        )
    head = ctx.store.documents.get(previous.session_id, HEAD, namespace=namespace)
    if head is not None and head.decode() == previous.id:
        return Placement(previous.session_id)
    return Placement(response_id, fork_from=previous.session_id)


def make_session(
    ctx: ServerContext, namespace: str, placement: Placement, priority: str, ttl_s: float
) -> None:
    """Create the placement's session (a fork, or a new chain's); call under the store lock, after
    the request was validated."""
    store = ctx.store
    try:
        if placement.fork_from is not None and placement.session_id is not None:
            child = store.fork(store.session(placement.fork_from, namespace), placement.session_id)
            if child.ttl_s is None:
                child.ttl_s = ttl_s
                store.checkpoint(child)
        elif placement.new_chain and placement.session_id is not None:
            store.create_session(placement.session_id, namespace, priority=priority, ttl_s=ttl_s)
    except ConfigError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
