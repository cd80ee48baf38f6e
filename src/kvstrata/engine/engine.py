"""The generation loop: reuse a session's stored KV, prefill only what is new, decode, persist.

One request goes through these steps:

1. tokenise the conversation (the chat template with the generation prompt);
2. find the longest cached prefix: the session's own tokens where they are a prefix of the new
   ones (an edited history truncates the session to the common part, so stale KV is never
   attended to), or the namespace's shared full blocks (a system prompt another session wrote),
   whichever is longer; at least one token is always left to prefill so that there are logits;
3. load it into a :class:`KVStrataCache` (a lost or corrupt block truncates the session there
   and the rest is recomputed: ``recomputed_reason`` says so);
4. prefill the remaining prompt tokens, then decode: a :class:`RequestDecoder` (per request, one
   row of logits at a time: sampling, grammar, stop rules, text) picks each token;
5. append the KV of every new token except the last generated one (its KV was never computed)
   and checkpoint, so the session's tokens are exactly the tokens whose KV is stored.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.engine.decoder import DecodeStep, RequestDecoder
from kvstrata.engine.grammar import GrammarCompiler
from kvstrata.engine.sampling import SamplingParams, TokenChoice
from kvstrata.errors import ConfigError, TierUnavailableError
from kvstrata.integrations.transformers.cache import KVStrataCache, layer_devices
from kvstrata.integrations.transformers.model import LoadedModel
from kvstrata.keys import LINEAGE_BYTES
from kvstrata.policy.memory import MemoryMode, MemoryModeKind
from kvstrata.priority import Priority
from kvstrata.store import DEFAULT_NAMESPACE, KVStore, LoadedKV
from kvstrata.store.sessions import Session
from kvstrata.store.tiers.base import TierLevel

Message = Mapping[str, Any]
StreamCallback = Callable[[str], None]


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
    ttft_ms: float
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


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One chat (``messages``) or completion (``prompt``) request, as queued by the scheduler.

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

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.messages, self.prompt, self.prompt_ids))
        if given != 1:
            raise ConfigError("a request has exactly one of messages, prompt or prompt_ids")
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


@dataclass(slots=True)
class _Prefix:
    kv: torch.Tensor | None
    num_tokens: int
    by_tier: dict[str, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    diverged_at: int | None = None
    source: LoadedKV | None = None
    """What the store returned (its buffer has room for the request's tokens: the cache adopts it)."""
    kept_blocks: list[int] | None = None
    """Set when a memory mode pruned the prefix: the session's full blocks ``kv`` holds (then
    the tail), in order; ``kv`` has fewer tokens than ``num_tokens``."""


class ResponseStream:
    """An iterator of text deltas (``steps()``: of :class:`DecodeStep` objects, with the tokens'
    log-probabilities and the finish); ``response`` is set once it is exhausted.

    The engine is held for the stream's request until it is exhausted or closed: iterate it to
    the end (or ``close()`` it) before starting another request on the same engine."""

    def __init__(self, steps: Generator[DecodeStep, None, Response]) -> None:
        self._steps = steps
        self.response: Response | None = None

    def __iter__(self) -> Iterator[str]:
        for step in self.steps():
            if step.text:
                yield step.text

    def steps(self) -> Iterator[DecodeStep]:
        self.response = yield from self._steps

    def close(self) -> None:
        self._steps.close()


class Engine:
    """Runs requests for many sessions on one model, against one store (one at a time)."""

    def __init__(
        self,
        model: LoadedModel,
        store: KVStore,
        *,
        queue_limit: int = 64,
        l1_resident_sessions: int = 4,
        track_importance: bool = False,
        memory_modes: Mapping[Priority | str, MemoryMode] | None = None,
    ) -> None:
        """``l1_resident_sessions``: how many sessions' KV may stay decoded in device memory
        between their requests; the least recently served beyond that are demoted to L2.
        ``track_importance``: measure the attention mass each block receives (eager attention
        through a registered hook) and feed it to the store's cost-based eviction.
        ``memory_modes``: lossy memory modes per priority class (off by default), for example
        ``{"background": MemoryMode("importance", 1024)}``; see :mod:`kvstrata.policy.memory`."""
        if l1_resident_sessions < 1:
            raise ConfigError("l1_resident_sessions must be >= 1")
        self.memory_modes = {Priority.parse(p): mode for p, mode in (memory_modes or {}).items()}
        for mode in self.memory_modes.values():
            mode.budget_blocks(store.layout.block_tokens)  # raises on a budget too small
            if mode.kind is MemoryModeKind.IMPORTANCE and not track_importance:
                raise ConfigError("the importance memory mode needs track_importance=True")
        layout = model.layout(store.layout.block_tokens)
        if layout != store.layout:
            raise ConfigError(f"the model's KV layout {layout} does not match the store's {store.layout}")
        if store.model_fingerprint != model.fingerprint:
            raise ConfigError("the store was opened with another model fingerprint than the model's")
        self.model = model
        self.store = store
        self._devices = layer_devices(model.model)
        self._input_device = model.model.get_input_embeddings().weight.device
        eos = model.model.generation_config.eos_token_id
        if eos is None:
            eos = model.tokenizer.eos_token_id
        self._stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._vocab_size = int(model.model.get_input_embeddings().weight.shape[0])
        self._grammars: GrammarCompiler | None = None
        self.queue_limit = queue_limit
        self.l1_resident_sessions = l1_resident_sessions
        self._resident: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._scheduler: Any = None
        self._prefetcher: Any = None
        self._tracker: Any = None
        self._last_request: dict[tuple[str, str], float] = {}
        self._gaps: dict[tuple[str, str], float] = {}
        if track_importance:
            from kvstrata.integrations.transformers.importance import ImportanceTracker

            self._tracker = ImportanceTracker(store.layout.block_tokens)
        self._lock = threading.Lock()
        # Restore buffers of finished requests, already paged in: a restore into fresh memory
        # spends most of its time in page faults (docs/benchmarks.md). At most two are kept.
        self._spare_buffers: list[torch.Tensor] = []

    # -- public API ------------------------------------------------------------------------------
    def chat(
        self,
        session_id: str,
        messages: Sequence[Message],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        namespace: str = DEFAULT_NAMESPACE,
        priority: Priority | str = Priority.INTERACTIVE,
        use_cache: bool = True,
        seed: int | None = None,
        stream: StreamCallback | None = None,
    ) -> Response:
        """Answer the conversation ``messages`` (the whole history, as the chat template takes it)."""
        request = GenerationRequest(
            session_id,
            messages=list(messages),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            namespace=namespace,
            priority=priority,
            use_cache=use_cache,
            seed=seed,
        )
        return self.run(request, stream=stream)

    def complete(
        self,
        session_id: str,
        prompt: str,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        namespace: str = DEFAULT_NAMESPACE,
        priority: Priority | str = Priority.INTERACTIVE,
        use_cache: bool = True,
        seed: int | None = None,
        stream: StreamCallback | None = None,
    ) -> Response:
        """Continue the raw text ``prompt`` (the whole text so far; no chat template)."""
        request = GenerationRequest(
            session_id,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            namespace=namespace,
            priority=priority,
            use_cache=use_cache,
            seed=seed,
        )
        return self.run(request, stream=stream)

    def stream(self, request: GenerationRequest) -> ResponseStream:
        """Iterate over the text deltas of ``request``; the response is on the stream afterwards."""
        return ResponseStream(self._generate(request))

    def run(self, request: GenerationRequest, *, stream: StreamCallback | None = None) -> Response:
        steps = self._generate(request)
        while True:
            try:
                step = next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if stream is not None and step.text:
                stream(step.text)

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles the grammars of constrained requests (built on first use: about 0.3 s)."""
        if self._grammars is None:
            eos = min(self._stop_ids) if self._stop_ids else self.model.tokenizer.eos_token_id
            self._grammars = GrammarCompiler(self.model.tokenizer, self._vocab_size, eos)
        return self._grammars

    def decoder(self, request: GenerationRequest) -> RequestDecoder:
        """The per-request decoding state of ``request``; raises :class:`ConfigError` for a
        request that cannot run (an invalid grammar, a stop token outside the vocabulary)."""
        params = request.params
        return RequestDecoder(
            params,
            self.model.tokenizer,
            eos_token_ids=self._stop_ids,
            vocab_size=self._vocab_size,
            grammars=self.grammars if params.grammar is not None else None,
        )

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self.model.tokenizer
        if request.prompt_ids is not None:
            vocab = self.model.model.get_input_embeddings().weight.shape[0]
            bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise ConfigError(f"prompt_ids holds ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
            if not request.prompt_ids:
                raise ConfigError("the prompt is empty")
            return list(request.prompt_ids)
        if request.messages is not None:
            extra = {"tools": list(request.tools)} if request.tools else {}
            encoded = tokenizer.apply_chat_template(
                [dict(m) for m in request.messages], add_generation_prompt=True, tokenize=True, **extra
            )
            ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        else:
            ids = tokenizer(request.prompt)["input_ids"]
        ids = [int(t) for t in ids]
        if not ids:
            raise ConfigError("the prompt is empty")
        return ids

    # -- the generation loop ---------------------------------------------------------------------
    def _generate(self, request: GenerationRequest) -> Generator[DecodeStep, None, Response]:
        # One request at a time: the model and the session state are not shared between requests.
        # Inference mode is entered per step (never across a yield), so that a stream's consumer
        # does not run its own code in inference mode.
        # The session's lease is held for the whole request: another process sharing the store (a
        # replica) gets SessionBusyError for it meanwhile instead of racing this one.
        realtime = request.priority is Priority.REALTIME and self._prefetcher is not None
        lease = (
            self.store.leased(request.session_id, request.namespace)
            if request.use_cache
            else contextlib.nullcontext()
        )
        with self._lock, lease:
            if realtime:
                self._prefetcher.realtime_started()  # background loading pauses meanwhile
            try:
                return (yield from self._generate_locked(request))
            finally:
                if realtime:
                    self._prefetcher.realtime_finished()

    def _generate_locked(self, request: GenerationRequest) -> Generator[DecodeStep, None, Response]:
        started = time.perf_counter()
        prompt_ids = self.prompt_token_ids(request)
        decoder = self.decoder(request)  # may refuse the request: before anything is written
        max_new_tokens = request.params.max_tokens
        session: Session | None = None
        if request.use_cache:
            session = self.store.create_session(
                request.session_id, request.namespace, priority=request.priority, exist_ok=True
            )
            mode = self.memory_modes.get(session.priority)
            with torch.inference_mode():
                capacity = len(prompt_ids) + max_new_tokens
                spare = self._take_spare(capacity)
                pruned = (
                    self._find_pruned_prefix(session, prompt_ids, mode, capacity, spare) if mode else None
                )
                prefix = pruned or self._find_prefix(session, prompt_ids, capacity, spare)
        else:
            prefix = _Prefix(None, 0, _tier_names({}))
        start = prefix.num_tokens
        # cache slots hold the attended tokens; with a pruned prefix, fewer than their positions
        slots = prefix.kv.shape[3] if prefix.kv is not None and prefix.kept_blocks is not None else start
        position_offset = start - slots
        total_new = len(prompt_ids) - start + max_new_tokens
        with torch.inference_mode():
            if prefix.source is not None:  # adopts the store's buffer when it has room
                cache = KVStrataCache.from_loaded(
                    prefix.source, slots, devices=self._devices, extra_tokens=total_new
                )
            else:
                cache = KVStrataCache.from_kv(
                    prefix.kv[:, :, :, :slots] if prefix.kv is not None else None,
                    len(self._devices),
                    devices=self._devices,
                    extra_tokens=total_new,
                )
        logits = self._forward(prompt_ids[start:], cache, position_offset)
        ttft_s = 0.0
        decode_started = time.perf_counter()
        while True:
            choice = decoder.choose(logits)
            if not decoder.token_ids:
                ttft_s = time.perf_counter() - started
                decode_started = time.perf_counter()
            step = decoder.accept(choice)
            if step.text or step.logprobs or step.finish_reason:
                yield step
            if step.finish_reason is not None:
                break
            logits = self._forward([choice.token], cache, position_offset)
        decode_s = time.perf_counter() - decode_started
        generated = decoder.token_ids

        if session is not None:
            # The last generated token was never fed to the model, so it has no KV: the session
            # stops before it, and the next turn prefills it (as part of its prompt).
            new_ids = prompt_ids[start:] + generated[:-1]
            assert cache.get_seq_length() == slots + len(new_ids)
            bt = self.store.layout.block_tokens
            if prefix.kept_blocks is not None and new_ids and not session.pruned:
                # From here on the session's KV is computed over a pruned context: its blocks
                # get keys of their own lineage, apart from exact blocks of the same tokens.
                session.lineage, session.lineage_from = os.urandom(LINEAGE_BYTES), start
            with torch.inference_mode():
                if new_ids:
                    self.store.append(session, new_ids, cache.new_kv(slots))
                self.store.checkpoint(session)
            self._keep_resident(session)
            self._record_importance(session, prefix.kept_blocks)
            self._recycle(prefix, cache)
            if prefix.kept_blocks is not None:  # blocks the session no longer attends to
                kept = set(prefix.kept_blocks)
                self.store.demote_from_l1(
                    k for i, k in enumerate(session.block_keys) if i not in kept and i * bt < start
                )
            self._record_signals(request, session, prompt_ids)

        return Response(
            session_id=request.session_id,
            namespace=request.namespace,
            text=decoder.text,
            token_ids=list(generated),
            prompt_tokens=len(prompt_ids),
            cached_tokens=start,
            cached_by_tier=prefix.by_tier,
            prefill_tokens=len(prompt_ids) - start,
            completion_tokens=len(generated),
            finish_reason=decoder.finish_reason or "length",
            ttft_ms=ttft_s * 1e3,
            decode_tokens_per_s=(len(generated) - 1) / decode_s
            if len(generated) > 1 and decode_s > 0
            else 0.0,
            total_ms=(time.perf_counter() - started) * 1e3,
            recomputed_reason="; ".join(prefix.reasons) or None,
            diverged_at=prefix.diverged_at,
            attended_tokens=slots if prefix.kept_blocks is not None else None,
            stop_reason=decoder.stop_reason,
            logprobs=decoder.logprobs if request.params.logprobs else None,
        )

    def forget(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Drop a deleted (or throwaway) session from the residency list, so that it does not
        push live sessions out of device memory."""
        self._resident.pop((namespace, session_id), None)

    def _keep_resident(self, session: Session) -> None:
        """Mark ``session`` most recently served; demote sessions beyond the residency limit
        from L1 (in the background), except blocks a resident session shares with them."""
        key = (session.namespace, session.id)
        self._resident.pop(key, None)
        self._resident[key] = session
        evicted = []
        while len(self._resident) > self.l1_resident_sessions:
            # the least recently served session of the lowest class leaves first: a burst of
            # background agents does not push the interactive and realtime ones out of L1
            victim = min(
                self._resident, key=lambda k: -self._resident[k].priority.rank
            )  # min() keeps the first (least recently served) of equal rank
            evicted.append(self._resident.pop(victim))
        if evicted:
            keep = {k for s in self._resident.values() for k in s.all_keys()}
            self.store.demote_from_l1(k for s in evicted for k in s.all_keys() if k not in keep)

    @torch.inference_mode()
    def _forward(
        self, token_ids: Sequence[int], cache: KVStrataCache, position_offset: int = 0
    ) -> torch.Tensor:
        """Logits after ``token_ids``. ``position_offset``: how far the tokens' positions lie past
        their cache slots (a pruned prefix keeps its original positions; so do the new tokens)."""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._input_device)
        kwargs: dict[str, Any] = {}
        if position_offset:
            first = cache.get_seq_length() + position_offset
            kwargs["position_ids"] = torch.arange(
                first, first + len(token_ids), device=self._input_device
            ).unsqueeze(0)
        if self._tracker is not None:
            with self._tracker.attached(self.model.model):
                out = self.model.model(
                    input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1, **kwargs
                )
        else:
            out = self.model.model(
                input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1, **kwargs
            )
        return out.logits[0, -1].float()

    def request_rate(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> float:
        """The session's request rate (requests/s), an exponential moving average; 0 if unknown."""
        gap = self._gaps.get((namespace, session_id))
        return 1.0 / gap if gap else 0.0

    def _record_signals(self, request: GenerationRequest, session: Session, prompt_ids: list[int]) -> None:
        """Per-session signals for the policy: the moving-average gap between requests (which
        becomes the expected time to the next use of the session's blocks) and the extent of the
        system prompt (whose blocks are protected from demotion like the attention sinks)."""
        key = (session.namespace, session.id)
        now = time.monotonic()
        last = self._last_request.get(key)
        self._last_request[key] = now
        if last is not None:
            gap = now - last
            previous = self._gaps.get(key)
            self._gaps[key] = gap if previous is None else 0.7 * previous + 0.3 * gap
        keys = session.all_keys()
        if key in self._gaps:
            self.store.set_next_use(keys, self._gaps[key])
        messages = request.messages or []
        if messages and messages[0].get("role") == "system":
            system_ids = self.model.tokenizer.apply_chat_template([messages[0]], tokenize=True)
            system_ids = system_ids["input_ids"] if hasattr(system_ids, "keys") else system_ids
            # the blocks that lie wholly inside the rendered system message
            full = (
                min(_common_prefix(list(system_ids), prompt_ids), session.num_tokens)
                // self.store.layout.block_tokens
            )
            self.store.protect(session.block_keys[:full])

    def _record_importance(self, session: Session, kept_blocks: list[int] | None = None) -> None:
        """Credit each of the session's blocks with the attention mass it received this request.

        With a pruned prefix the cache's first blocks were the kept full blocks: only those are
        credited (the slots after them do not line up with the session's blocks)."""
        if self._tracker is None:
            return
        keys = session.all_keys() if kept_blocks is None else [session.block_keys[i] for i in kept_blocks]
        mass = self._tracker.normalized(len(keys))
        self._tracker.reset()
        self.store.add_importance(zip(keys, mass.tolist(), strict=True))

    # -- prefix reuse ----------------------------------------------------------------------------
    def _take_spare(self, tokens: int) -> torch.Tensor | None:
        """The smallest spare restore buffer with room for ``tokens`` (taken out of the pool)."""
        fits = [b for b in self._spare_buffers if b.shape[3] >= tokens]
        if not fits:
            return None
        best = min(fits, key=lambda b: b.shape[3])
        self._spare_buffers = [b for b in self._spare_buffers if b is not best]
        return best

    def _recycle(self, prefix: _Prefix, cache: KVStrataCache) -> None:
        """Keep the request's restore buffer for a later request, once nothing else uses it (the
        store copied what it keeps; the cache is dropped after this)."""
        buffer = prefix.source.buffer if prefix.source is not None else None
        layer = cache.layers[0] if cache.layers else None
        own = getattr(layer, "_key_buffer", None)
        if (
            buffer is None
            or own is None
            or own.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        ):
            return  # the cache copied the KV, or outgrew the buffer: nothing to keep
        self._spare_buffers = sorted([*self._spare_buffers, buffer], key=lambda b: b.shape[3])[-2:]

    def _find_prefix(
        self, session: Session, prompt_ids: list[int], capacity: int = 0, spare: torch.Tensor | None = None
    ) -> _Prefix:
        """Load the longest cached prefix of ``prompt_ids`` (leaving at least one token), and make
        the session's tokens exactly that prefix."""
        store = self.store
        usable = len(prompt_ids) - 1
        reasons: list[str] = []
        common = _common_prefix(session.token_ids, prompt_ids)
        own_tokens = min(common, usable)
        diverged_at = common if common < session.num_tokens else None
        # Load before truncating, so that the tiers reported are where the KV was found (the
        # truncation reads a kept partial block again, from memory by then).
        own = store.load(session, own_tokens, capacity=capacity, out=spare) if own_tokens else _empty_load()
        if own.missing_from_token is not None:
            reasons.append(
                f"a block at token {own.missing_from_token} was lost or corrupt; recomputed from there"
            )
        if own.num_tokens < session.num_tokens:
            self._truncate(session, own.num_tokens, reasons)
        kept = session.num_tokens  # below own.num_tokens only if the kept partial block was lost
        by_tier = own.tokens_by_tier if kept == own.num_tokens else {}
        best = _Prefix(
            own.kv if kept else None, kept, _tier_names(by_tier), reasons, diverged_at, own if kept else None
        )

        bt = store.layout.block_tokens
        # (a pruned session's blocks are not the exact chain: shared exact blocks cannot extend it)
        if usable // bt * bt > best.num_tokens and not session.pruned:
            shared_keys = store.match_prefix(session.namespace, prompt_ids[:usable])
            if len(shared_keys) * bt > best.num_tokens:
                # (the spare buffer, if any, may hold the session's own KV by now)
                shared = store.load_blocks(
                    shared_keys,
                    len(shared_keys) * bt,
                    priority=session.priority,
                    capacity=capacity,
                    out=spare if own.buffer is not spare else None,
                )
                if shared.kv is not None and shared.num_tokens > best.num_tokens:
                    # Content-addressed keys: the session's own blocks are the first shared ones,
                    # so the shared KV extends what the session holds.
                    extra = prompt_ids[session.num_tokens : shared.num_tokens]
                    store.append(session, extra, shared.kv[:, :, :, session.num_tokens : shared.num_tokens])
                    best = _Prefix(
                        shared.kv,
                        shared.num_tokens,
                        _tier_names(shared.tokens_by_tier),
                        reasons,
                        diverged_at,
                        shared,
                    )
        assert session.token_ids == prompt_ids[: best.num_tokens]
        return best

    def _find_pruned_prefix(
        self,
        session: Session,
        prompt_ids: list[int],
        mode: MemoryMode,
        capacity: int = 0,
        spare: torch.Tensor | None = None,
    ) -> _Prefix | None:
        """With a memory mode, when the prompt continues the session and its history exceeds the
        mode's budget: load only the kept blocks (and the tail). None when the ordinary path
        applies: within the budget, an edited history (truncated there), or a kept block lost
        (recomputed from there)."""
        bt = self.store.layout.block_tokens
        if session.num_tokens > len(prompt_ids) - 1:
            return None
        if _common_prefix(session.token_ids, prompt_ids) < session.num_tokens:
            return None
        full = len(session.block_keys)
        importance = None
        if mode.kind is MemoryModeKind.IMPORTANCE:
            importance = [self.store.importance(key) for key in session.block_keys]
        system = [i for i, key in enumerate(session.block_keys) if self.store.is_protected(key)]
        kept = mode.keep(full, bt, importance, protected=system)
        if kept is None:
            return None
        keys = [session.block_keys[i] for i in kept]
        if session.tail_key is not None:
            keys.append(session.tail_key)
        want = len(kept) * bt + session.num_tokens - full * bt
        loaded = self.store.load_blocks(
            keys, want, full_blocks=len(kept), priority=session.priority, capacity=capacity, out=spare
        )
        if loaded.kv is None or loaded.num_tokens < want:
            return None
        session.last_access = time.time()
        return _Prefix(
            loaded.kv, session.num_tokens, _tier_names(loaded.tokens_by_tier), source=loaded, kept_blocks=kept
        )

    def _truncate(self, session: Session, num_tokens: int, reasons: list[str]) -> None:
        try:
            self.store.truncate(session, num_tokens)
        except TierUnavailableError as exc:
            # The partial block to keep is lost: fall back to the last full block boundary.
            reasons.append(f"could not keep a partial block ({exc}); recomputed from the block before")
            bt = self.store.layout.block_tokens
            self.store.truncate(session, min(session.num_tokens, num_tokens // bt * bt))

    # -- scheduling ------------------------------------------------------------------------------
    def hint(self, next: Sequence[str], namespace: str = DEFAULT_NAMESPACE) -> None:
        """Say which sessions run next: their blocks are loaded into device memory in the
        background, overlapping the current request's compute."""
        if self._prefetcher is None:
            from kvstrata.engine.prefetch import Prefetcher

            self._prefetcher = Prefetcher(self.store)
        self._prefetcher.hint(list(next), namespace)

    def submit(self, request: GenerationRequest) -> Any:
        """Queue ``request``: realtime before interactive before background, FIFO within a class.

        Returns a ``concurrent.futures.Future`` of the :class:`Response`; raises
        :class:`QueueFullError` when ``queue_limit`` requests are waiting already.
        """
        if self._scheduler is None:
            from kvstrata.engine.scheduler import Scheduler

            self._scheduler = Scheduler(self.run, queue_limit=self.queue_limit)
        future = self._scheduler.submit(request)
        if request.use_cache:
            self.hint([request.session_id], request.namespace)  # a queued request prefetches itself
        return future

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _tier_names(by_tier: dict[TierLevel, int]) -> dict[str, int]:
    names = {level.name: 0 for level in TierLevel}
    for level, tokens in by_tier.items():
        names[level.name] += tokens
    return names


def _empty_load() -> LoadedKV:
    return LoadedKV(None, 0, {}, None)
