"""The soak's agents: asyncio clients of ``kvstrata serve`` (httpx), each holding one conversation
after another in sessions of its class. Realtime agents' replies are checked against a recompute
on a sample; interactive agents fork now and then; background agents' sessions carry a TTL and
are abandoned, for gc to expire. A gate lets the run pause them all (no request in flight) while
it restarts or kills the server."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.bench.soak.params import CHECKED_CLASS, PERIOD_S, Check, Events, SoakParams, Turn

if TYPE_CHECKING:
    import httpx

TIE_LOGPROB = 1e-3
"""Where a reply and its recompute part, a recompute whose top two tokens are this close in
log-probability is a tie that rounding decides (prefilling in one pass or on top of restored KV
sums in another order), not a wrong reply."""
WORDS = ["trip", "hotel", "train", "museum", "lake", "budget", "notes", "plan", "route", "weather", "map"]


class Gate:
    """Requests pass while it is open; :meth:`drain` closes it and waits until none is in flight."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0

    async def enter(self) -> None:
        await self._open.wait()
        self._inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def drain(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def resume(self) -> None:
        self._open.set()


@dataclass
class Reply:
    ok: bool
    text: str = ""
    tokens: list[dict[str, Any]] = field(default_factory=list)
    """``logprobs.content`` entries: token, logprob, top_logprobs."""
    ttft_s: float | None = None
    error: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class Workload:
    """Shared by the agents: where to send, with which keys, and what they record."""

    params: SoakParams
    http: httpx.AsyncClient
    model_id: str
    tenant_key: str
    reference_keys: list[str]
    """One fresh tenant per recompute: a tenant's first request reuses nothing."""
    started: float
    deadline: float
    gate: Gate
    events: Events
    system: dict[str, str]
    """Each class's shared system prompt (the prefix its agents share)."""
    turns: list[Turn] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    replies: dict[int, int] = field(default_factory=dict)
    """Replies each agent had, across its conversations: every ``check_every``-th is checked (counted
    within one conversation, none was when ``max_turns < check_every``)."""

    def now(self) -> float:
        return time.monotonic() - self.started

    async def agent(self, index: int) -> None:
        cls = self.params.classes[index % len(self.params.classes)]
        period = PERIOD_S[cls] * self.params.pace
        rng = random.Random(index)
        await asyncio.sleep(rng.uniform(0, min(period, self.params.duration_s)))
        conversation = 0
        while time.monotonic() < self.deadline:
            session = f"agent{index}-c{conversation}"
            conversation += 1
            await self._conversation(index, cls, session, period, rng)

    async def _conversation(
        self, index: int, cls: str, session: str, period: float, rng: random.Random
    ) -> None:
        if cls == "background":  # made with a TTL, then abandoned: gc expires it
            created = await self._admin_call(
                "POST", "/v1/sessions", {"id": session, "priority": cls, "ttl_s": self.params.ttl_s}
            )
            if created:
                self.events.ttl_sessions += 1
        history = [
            {"role": "system", "content": f"{self.system[cls]}\nYou are agent {index}."},
        ]
        for turn in range(self.params.max_turns):
            if time.monotonic() >= self.deadline:
                return
            history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 12)))})
            sent = list(history)
            reply = await self._chat(sent, session, cls, index, "turn")
            if not reply.ok:
                history.pop()
            else:
                history.append({"role": "assistant", "content": reply.text})
                self.replies[index] = replies = self.replies.get(index, 0) + 1
                if cls == CHECKED_CLASS and replies % self.params.check_every == 0:
                    await self._check(index, sent, reply)
                if cls == "interactive" and turn % self.params.fork_every == self.params.fork_every - 1:
                    await self._fork(index, session, history, rng)
            left = max(0.0, self.deadline - time.monotonic())
            await asyncio.sleep(min(period * rng.uniform(0.8, 1.2), left))
        if cls != "background":
            await self._admin_call("DELETE", f"/v1/sessions/{session}", None)

    async def _fork(
        self, index: int, session: str, history: list[dict[str, str]], rng: random.Random
    ) -> None:
        fork = f"{session}-fork{len(history)}"
        if not await self._admin_call("POST", f"/v1/sessions/{session}/fork", {"id": fork}):
            return
        self.events.forks += 1
        question = {"role": "user", "content": "Instead: " + " ".join(rng.choices(WORDS, k=5))}
        await self._chat([*history, question], fork, "interactive", index, "fork")
        await self._admin_call("DELETE", f"/v1/sessions/{fork}", None)

    async def _check(self, index: int, sent: list[dict[str, str]], reply: Reply) -> None:
        if not self.reference_keys:
            return
        key = self.reference_keys.pop()
        reference = await self._chat(sent, None, CHECKED_CLASS, index, "check", key=key)
        if not reference.ok:
            return  # counted as a failed request
        if reference.cached_tokens:
            verdict, detail = "wrong", f"the recompute reused {reference.cached_tokens} tokens"
        else:
            verdict, detail = compare(reply.tokens, reference.tokens)
        self.checks.append(Check(self.now(), index, verdict, detail))

    async def _admin_call(self, method: str, path: str, body: dict[str, Any] | None) -> bool:
        """A session admin request of the agent's tenant; recorded as a turn of kind ``admin``."""
        import httpx

        await self.gate.enter()
        t = self.now()
        try:
            response = await self.http.request(
                method, path, json=body, headers={"Authorization": f"Bearer {self.tenant_key}"}
            )
            ok = response.status_code < 300
            error = None if ok else f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        finally:
            self.gate.leave()
        self.turns.append(Turn(t, -1, "admin", f"admin {method}", ok, error=error))
        return ok

    async def _chat(
        self,
        messages: list[dict[str, str]],
        session: str | None,
        cls: str,
        index: int,
        kind: str,
        *,
        key: str | None = None,
    ) -> Reply:
        await self.gate.enter()
        t = self.now()
        try:
            reply = await self._stream(messages, session, cls, key or self.tenant_key)
        finally:
            self.gate.leave()
        self.turns.append(
            Turn(
                t,
                index,
                cls,
                kind,
                reply.ok,
                reply.ttft_s,
                reply.error,
                reply.cached_tokens,
                reply.prompt_tokens,
            )
        )
        return reply

    async def _stream(self, messages: list[dict[str, str]], session: str | None, cls: str, key: str) -> Reply:
        import httpx

        body = {
            "model": self.model_id,
            "messages": messages,
            "max_tokens": self.params.max_tokens,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {key}", "X-Priority": cls}
        if session is not None:
            headers["X-Session-Id"] = session
        reply = Reply(ok=False)
        started = time.perf_counter()
        try:
            async with self.http.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    reply.error = f"{response.status_code} {(await response.aread())[:200]!r}"
                    return reply
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    _absorb(reply, json.loads(line[6:]), started)
        except httpx.HTTPError as exc:
            reply.error = f"{type(exc).__name__}: {exc}"
            return reply
        reply.ok = reply.error is None
        return reply


def _absorb(reply: Reply, chunk: dict[str, Any], started: float) -> None:
    if "error" in chunk:
        reply.error = str(chunk["error"])[:200]
        return
    usage = chunk.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens", 0)
        reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for choice in chunk.get("choices", []):
        content = (choice.get("delta") or {}).get("content")
        if content:
            if reply.ttft_s is None:
                reply.ttft_s = time.perf_counter() - started
            reply.text += content
        logprobs = choice.get("logprobs") or {}
        reply.tokens += logprobs.get("content") or []


def compare(got: list[dict[str, Any]], reference: list[dict[str, Any]]) -> tuple[str, str]:
    """``same``, ``tie`` or ``wrong`` (see :class:`~kvstrata.bench.soak.params.Check`), and where."""
    for i, (mine, theirs) in enumerate(zip(got, reference, strict=False)):
        if mine["token"] == theirs["token"]:
            continue
        tops = {t["token"]: t["logprob"] for t in theirs.get("top_logprobs") or []}
        if mine["token"] in tops and abs(tops[mine["token"]] - theirs["logprob"]) <= TIE_LOGPROB:
            return "tie", f"token {i}: {mine['token']!r} and {theirs['token']!r} within {TIE_LOGPROB}"
        return "wrong", f"token {i}: {mine['token']!r}, the recompute {theirs['token']!r}"
    if len(got) != len(reference):
        return "wrong", f"{len(got)} tokens, the recompute {len(reference)}"
    return "same", ""
