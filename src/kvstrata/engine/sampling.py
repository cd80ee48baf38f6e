"""What a request asks of decoding (:class:`SamplingParams`), and picking one token from one row
of logits by those rules (:class:`TokenSampler`).

The order of operations is vLLM's (and OpenAI's where it says): log-probabilities are reported
from the model's raw logits (before penalties, masks and temperature); then presence/frequency
penalties over the tokens generated so far, vLLM's ``repetition_penalty`` over the prompt's and
the generated tokens, ``logit_bias``, the masks (a grammar's, and EOS banned before
``min_tokens``), then greedy choice at temperature 0, else temperature, ``top_k`` and nucleus
(``top_p``) sampling from a per-request generator (a request with a ``seed`` samples the same
tokens again).

Everything here works on ONE row of logits and per-request state, so a batched decoding loop
runs one sampler per row (see :mod:`kvstrata.engine.decoder`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvstrata.engine.grammar import GrammarSpec
from kvstrata.errors import ConfigError

MAX_TOP_LOGPROBS = 20
SEED_MODULUS = 2**64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request decodes (the OpenAI fields, plus vLLM's ``min_tokens``, ``ignore_eos``,
    ``stop_token_ids``). Validated on construction (:class:`ConfigError`)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    """Strings that end the output; the text stops before the first of them (never included)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the output besides EOS (their text is not included)."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` are banned, and ``stop`` strings not looked for, until this many
    tokens were generated."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it for fixed output lengths)."""
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: GrammarSpec | None = None
    """Constrained decoding: the output must be a sentence of this grammar."""
    whole_items: bool = False
    """The grammar's sentences are items one after another (tool calls): at a point where the
    output is complete, it ends when the tokens left could not hold another item as long as the
    longest so far, so that ``max_tokens`` does not cut one."""
    top_k: int = 0
    """Sample from the ``top_k`` most likely tokens only (0: all; vLLM's -1 is taken as 0)."""
    repetition_penalty: float = 1.0
    """vLLM's (and transformers'): the scores of tokens already in the prompt or the output are
    divided by it where positive, multiplied where negative (1: off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the scores (OpenAI's ``logit_bias``, each in [-100, 100])."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError("temperature must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError("top_p must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ConfigError(f"{name} must be in [-2, 2]")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError("min_tokens must be in [0, max_tokens]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise ConfigError("top_logprobs needs logprobs")
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed) % SEED_MODULUS)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.top_k < 0:
            raise ConfigError("top_k must be >= 0 (or -1: all tokens)")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError("repetition_penalty must be a finite number > 0")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(t < 0 or not (math.isfinite(b) and -100 <= b <= 100) for t, b in bias):
            raise ConfigError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of the ``index``-th of ``n`` choices: a seeded request's choices get
        seeds ``seed``, ``seed + 1``, ... (as vLLM does), so they differ yet repeat."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % SEED_MODULUS)


@dataclass(frozen=True, slots=True)
class TokenChoice:
    """The token picked from one row of logits, with its log-probability (when asked for)."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The ``top_logprobs`` most likely tokens and their log-probabilities, best first."""


@dataclass(slots=True)
class TokenSampler:
    """Per-request sampling state: the generator and the counts the penalties need."""

    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    prompt_ids: Sequence[int] = ()
    """The prompt's tokens (what ``repetition_penalty`` counts besides the output)."""
    _generator: torch.Generator | None = None
    _counts: torch.Tensor | None = None
    _seen: torch.Tensor | None = None

    def choose(
        self, logits: torch.Tensor, *, allowed: torch.Tensor | None = None, banned: Sequence[int] = ()
    ) -> TokenChoice:
        """Pick the next token from ``logits`` (one row: the vocabulary). ``allowed``: a bool mask
        of the tokens that may be picked (a grammar's); ``banned``: tokens that may not be."""
        params = self.params
        raw = logits.float()
        logprob, top = None, ()
        if params.logprobs:
            logprobs = torch.log_softmax(raw, dim=-1)
        scores = raw
        if params.presence_penalty or params.frequency_penalty:
            counts = self._token_counts(raw)
            scores = (
                scores
                - params.presence_penalty * (counts > 0).to(scores.dtype)
                - params.frequency_penalty * counts.to(scores.dtype)
            )
        if params.repetition_penalty != 1:
            seen = self._seen_tokens(raw)
            penalised = torch.where(
                scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty
            )
            scores = torch.where(seen, penalised, scores)
        if params.logit_bias:
            scores = scores.clone() if scores is raw else scores
            ids = torch.tensor([t for t, _ in params.logit_bias], device=scores.device)
            bias = torch.tensor([b for _, b in params.logit_bias], dtype=scores.dtype, device=scores.device)
            scores.index_add_(0, ids, bias)
        if allowed is not None or banned:
            scores = scores.clone() if scores is raw else scores
            if allowed is not None:
                scores = scores.masked_fill(~allowed, -math.inf)
            if banned:
                scores[torch.tensor(list(banned), device=scores.device)] = -math.inf
        token = _greedy(scores) if params.greedy else self._sample(scores)
        if params.logprobs:
            logprob = float(logprobs[token])
            if params.top_logprobs:
                values, ids = torch.topk(logprobs, params.top_logprobs)
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenChoice(token, logprob, top)

    def accept(self, token: int) -> None:
        self.generated.append(token)
        if self._counts is not None:
            self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True

    def _seen_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        if self._seen is None:
            self._seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            ids = [*self.prompt_ids, *self.generated]
            if ids:
                self._seen[torch.tensor(ids, device=logits.device)] = True
        return self._seen

    def _token_counts(self, logits: torch.Tensor) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(logits.shape[-1], dtype=torch.int32, device=logits.device)
            if self.generated:
                ids = torch.tensor(self.generated, device=logits.device)
                self._counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return self._counts

    def _sample(self, scores: torch.Tensor) -> int:
        if self._generator is None:
            # per request, so that one request's draws never shift another's; unseeded ones
            # draw their seed from the OS
            seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator(device=scores.device).manual_seed(seed)
        # shifted so the largest score is 0, in float64: a tiny temperature then gives -inf for
        # the others (and 0 for the best), never inf/inf = nan
        scaled = (scores.double() - scores.max().double()) / self.params.temperature
        if 0 < self.params.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, self.params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        probs = torch.softmax(scaled, dim=-1)
        if self.params.top_p < 1:
            probs = _nucleus(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator))


def _greedy(scores: torch.Tensor) -> int:
    return int(torch.argmax(scores))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities add up to ``top_p`` (at least one)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the better tokens
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum()
