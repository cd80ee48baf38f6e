"""Per-request decoding: one request's sampling, constraint, stop rules and text, one row at a time.

The contract (what a generation loop, single-request or batched, relies on)::

    decoder = RequestDecoder(params, tokenizer, eos_token_ids=..., vocab_size=..., grammars=...)
    logits = forward(prompt)                  # this request's row of the last position's logits
    while True:
        choice = decoder.choose(logits)       # TokenChoice(token, logprob, top_logprobs)
        step = decoder.accept(choice)         # DecodeStep(text, logprobs, finish_reason)
        emit(step)                            # text safe to show: no stop string, no part of one
        if step.finish_reason:
            break
        logits = forward([choice.token])

- ``choose`` reads ONE row of logits (shape ``[vocab]``) and the request's own state (its
  grammar's mask, its generator, its penalties' counts); it does not change that state, so a
  batched loop may call it for each row of a batch in any order. Requests with different
  constraints, temperatures and seeds mix freely in one batch.
- ``accept`` advances the request by the chosen token (grammar, penalties, text, stop strings,
  ``max_tokens``) and says whether the request is finished: ``"stop"`` (EOS, a stop token, a stop
  string, or a grammar that is complete) or ``"length"``. The finishing token is still part of
  :attr:`token_ids` (it was sampled), but its KV need not be computed.
- Construction raises :class:`ConfigError` for requests that cannot run (an invalid grammar, a
  stop token outside the vocabulary): build decoders before anything is written for a request.

The final result is on the decoder afterwards: :attr:`text` (everything released), :attr:`token_ids`,
:attr:`finish_reason`, :attr:`stop_reason` (the stop string or stop token id that ended it, as vLLM
reports it) and :attr:`logprobs`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.engine.grammar import Constraint, GrammarCompiler, GrammarError
from kvstrata.engine.sampling import SamplingParams, TokenChoice, TokenSampler
from kvstrata.engine.stops import IncrementalText, StopStrings
from kvstrata.errors import ConfigError


@dataclass(slots=True)
class DecodeStep:
    """What accepting one token released."""

    text: str = ""
    """New text that is final (no stop string, no possible start of one, no partial character)."""
    logprobs: list[TokenChoice] = field(default_factory=list)
    """The accepted token's choice, when log-probabilities were asked for (else empty)."""
    finish_reason: str | None = None


class RequestDecoder:
    """One request's decoding state, from its first sampled token to its finish."""

    def __init__(
        self,
        params: SamplingParams,
        tokenizer: Any,
        *,
        eos_token_ids: Collection[int],
        vocab_size: int,
        grammars: GrammarCompiler | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ConfigError(f"stop_token_ids outside the vocabulary (0..{vocab_size - 1}): {bad[:5]}")
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:
            raise ConfigError(f"logit_bias: tokens outside the vocabulary (0..{vocab_size - 1}): {bad[:5]}")
        self.params = params
        self.vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos)
        self._banned_early = sorted(self._eos | frozenset(params.stop_token_ids))
        self._constraint: Constraint | None = None
        if params.grammar is not None:
            if grammars is None:
                raise ConfigError("this engine cannot constrain decoding (no grammar compiler)")
            self._constraint = grammars.constraint(params.grammar)
        self._sampler = TokenSampler(params, prompt_ids=prompt_ids)
        self._item_start = 0  # with whole_items: where the item being generated began
        self._longest_item = 0
        self._text = IncrementalText(tokenizer)
        self._stops = StopStrings(params.stop)
        self._released = 0  # characters of the text released so far
        self.token_ids: list[int] = []
        self.logprobs: list[TokenChoice] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: torch.Tensor) -> TokenChoice:
        """The next token from this request's row of logits (``[vocab]``, or wider: the extra
        columns a model pads its vocabulary with are never chosen)."""
        assert not self.finished, "the request is finished"
        row = logits[: self.vocab_size] if logits.shape[-1] > self.vocab_size else logits
        under_min = len(self.token_ids) < self.params.min_tokens
        banned = self._banned_early if under_min else ()
        if self._constraint is None:
            return self._sampler.choose(row, banned=banned)
        allowed = self._constraint.allowed(row.device)
        if not bool(allowed.any()):
            raise GrammarError("the grammar allows no token here")
        if banned:
            early = allowed.clone()
            early[torch.tensor(banned, device=row.device)] = False
            if bool(early.any()):  # a complete grammar allows only EOS: then it wins over min_tokens
                allowed = early
        return self._sampler.choose(row, allowed=allowed)

    def accept(self, choice: TokenChoice | int) -> DecodeStep:
        """Advance by the chosen token; what that released, and whether the request is done."""
        assert not self.finished, "the request is finished"
        if isinstance(choice, int):
            choice = TokenChoice(choice)
        token = choice.token
        self.token_ids.append(token)
        self._sampler.accept(token)
        step = DecodeStep()
        if self.params.logprobs:
            self.logprobs.append(choice)
            step.logprobs.append(choice)
        if self._constraint is not None:
            self._constraint.consume(token)
        if token in self._stop_ids:
            # the stop token's own text is not part of the output
            self.stop_reason = token if token not in self._eos else None
            return self._finish(step, "stop")
        self._text.add(token)
        text = self._text.text
        if self._stops and len(self.token_ids) > self.params.min_tokens:
            new_chars = len(text) - self._released
            found = self._stops.find(text, new_chars)
            if found is not None:
                at, stop = found
                self.stop_reason = stop
                return self._finish(step, "stop", end=at)
        if self._constraint is not None and self._constraint.done:
            return self._finish(step, "stop")
        if self.params.whole_items and self._constraint is not None and self._constraint.accepting:
            generated = len(self.token_ids)
            self._longest_item = max(self._longest_item, generated - self._item_start)
            self._item_start = generated
            if self.params.max_tokens - generated <= self._longest_item:  # another would be cut
                return self._finish(step, "stop")
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish(step, "length")
        keep = self._stops.holdback(text) if self._stops else 0
        step.text = self._release(len(text) - keep)
        return step

    def _release(self, upto: int) -> str:
        upto = max(upto, self._released)
        delta = self._text.text[self._released : upto]
        self._released = upto
        self.text += delta
        return delta

    def _finish(self, step: DecodeStep, reason: str, *, end: int | None = None) -> DecodeStep:
        if end is None:
            self._text.flush()
            end = len(self._text.text)
        step.text = self._release(end)
        step.finish_reason = self.finish_reason = reason
        return step
