"""What a caller gives the engine (:class:`GenerationRequest`) and gets back (:class:`Response`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.engine.sampling import SamplingParams, TokenChoice
from kvstrata.errors import ConfigError
from kvstrata.priority import Priority
from kvstrata.store import DEFAULT_NAMESPACE

Message = Mapping[str, Any]


@dataclass(slots=True)
class Response:
    """What one request produced, and where its prompt's KV came from."""

    session_id: str
    namespace: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    prefill_tokens: int
    completion_tokens: int
    finish_reason: str
    """``stop``, ``length``, or ``cancelled`` (the caller cancelled it; what it computed is kept)."""
    ttft_ms: float
    """From the request's submission to its first token: waiting for a place in the batch, the
    restore of its prefix and its prefill included."""
    decode_tokens_per_s: float
    total_ms: float
    recomputed_reason: str | None = None
    """Why tokens the store held were recomputed (a lost or corrupt block); None if none were."""
    diverged_at: int | None = None
    """Where the prompt first differed from the session's stored tokens (an edited history, or
    an answer that tokenises differently when re-rendered); the KV after it was dropped."""
    attended_tokens: int | None = None
    """With a lossy memory mode: how many of the ``cached_tokens`` the request attended to (the
    kept blocks); None when it attended to all of them."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the output (None: EOS, a grammar, the length)."""
    logprobs: list[TokenChoice] | None = None
    """Each generated token's choice with its log-probability, when the request asked for them."""
    queued_ms: float = 0.0
    """From submission to the step that took the request into the batch (its row restored)."""
    inter_token_ms: list[float] = field(default_factory=list)
    """The time between each generated token and the one before it."""
    request_id: str = ""
    """The engine's id of the request (what :class:`~kvstrata.engine.stepper.StepReport` names)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One chat (``messages``) or completion (``prompt``) request.

    How it decodes is ``sampling``; ``max_new_tokens``, ``temperature`` and ``seed`` are
    shorthands for the common fields (give them or ``sampling``, not both), and after
    construction they mirror ``sampling``."""

    session_id: str
    messages: Sequence[Message] | None = None
    prompt: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    namespace: str = DEFAULT_NAMESPACE
    priority: Priority | str = Priority.INTERACTIVE
    use_cache: bool = True
    seed: int | None = None
    prompt_ids: Sequence[int] | None = None
    """Token ids given directly (no template, no tokenizer), instead of messages or a prompt."""
    sampling: SamplingParams | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    """Tool definitions for a chat template that renders them itself (``apply_chat_template(
    tools=...)``); the messages may then carry ``tool_calls`` and ``tool`` turns."""
    template_kwargs: Mapping[str, Any] | None = None
    """Extra keyword arguments of the chat template (vLLM's ``chat_template_kwargs``)."""
    ttl_s: float | None = None
    """The TTL a session this request creates gets (one that gc expired and the agent came back
    to included): gc deletes it once idle this long. A session that exists keeps its own."""
    transient: bool = False
    """The caller deletes the session once this request is answered (a stateless request): a
    session this request creates keeps no exact recent window
    (:attr:`kvstrata.store.sessions.Session.transient`)."""
    idle: bool = False
    """Run only in engine steps that have nothing else to run, and yield to the session's next
    request (which cancels it; what it computed is kept): the engine's recompute of an upgraded
    session's lossy blocks (:mod:`kvstrata.engine.upgrades`)."""

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.messages, self.prompt, self.prompt_ids))
        if given != 1:
            raise ConfigError("a request has exactly one of messages, prompt or prompt_ids")
        if self.ttl_s is not None and not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ConfigError("ttl_s must be a positive number of seconds")
        if self.prompt_ids is not None:
            object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if self.sampling is None:
            if self.max_new_tokens < 1:
                raise ConfigError("max_new_tokens must be >= 1")
            if self.temperature < 0:
                raise ConfigError("temperature must be >= 0")
            sampling = SamplingParams(self.max_new_tokens, self.temperature, seed=self.seed)
            object.__setattr__(self, "sampling", sampling)
        elif (self.max_new_tokens, self.temperature, self.seed) != (64, 0.0, None):
            raise ConfigError("give sampling, or max_new_tokens/temperature/seed, not both")
        else:
            object.__setattr__(self, "max_new_tokens", self.sampling.max_tokens)
            object.__setattr__(self, "temperature", self.sampling.temperature)
            object.__setattr__(self, "seed", self.sampling.seed)
        object.__setattr__(self, "priority", Priority.parse(self.priority))

    @property
    def params(self) -> SamplingParams:
        assert self.sampling is not None  # set by __post_init__
        return self.sampling
