"""Constrained decoding: a grammar (JSON schema or Lark) masks the tokens a request may sample.

The grammar engine is llguidance (Microsoft's, maintained, on PyPI; it also backs vLLM's and
llama.cpp's structured output). It was chosen over xgrammar because it has no torch dependency
(xgrammar pins torch, and this project's torch is a local CPU build), it compiles a JSON schema
or a Lark grammar lazily (no per-schema precompilation pause on first use of a new schema), and
its Lark dialect embeds JSON schemas (``%json {...}``), which is how tool calls are constrained
(:mod:`kvstrata.server.tools`).

What this module owns:

- :class:`GrammarSpec`: a constraint as plain data (what a request asks for); hashable, so that
  compiled grammars are cached across requests (an agent resends the same tools every step);
- :class:`GrammarCompiler`: one per tokenizer; turns specs into per-request :class:`Constraint`
  objects and validates them up front (a bad schema is a :class:`ConfigError`, a 400);
- :class:`Constraint`: one request's matcher state. It works on ONE row of logits at a time
  (``allowed()`` is that row's mask), so a batch may mix requests with different constraints,
  or none.

JSON is generated compactly and deterministically (``{"a": 1, "b": [2, 3]}``: no free
whitespace, properties in schema order), so a small model cannot wander into whitespace, and the
same value always renders the same way (which keeps an agent's re-sent history tokenising as it
was generated).
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstrata.errors import ConfigError, KVStrataError

JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # keywords llguidance does not enforce (formats, some string patterns) are ignored rather
    # than refused: frameworks put them in generated schemas (pydantic's "format": "date-time")
    "lenient": True,
}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_CACHED_GRAMMARS = 64


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    LARK = "lark"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's output. ``source`` is a JSON schema (serialised) or a Lark
    grammar (whose rules may embed JSON schemas with ``%json {...}``)."""

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | None = None) -> GrammarSpec:
        """Output is one JSON value valid against ``schema`` (None: any JSON object)."""
        schema = ANY_JSON_OBJECT if schema is None else schema
        if not isinstance(schema, Mapping | bool):
            raise ConfigError("a JSON schema is an object (or true/false)")
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, sort_keys=False, ensure_ascii=False))

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls(GrammarKind.LARK, grammar)

    def _llguidance(self) -> str:
        from llguidance import LLMatcher

        if self.kind is GrammarKind.JSON_SCHEMA:
            try:
                return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
            except ValueError as exc:
                raise ConfigError(f"invalid JSON schema: {exc}") from exc
        return LLMatcher.grammar_from_lark(self.source)


class GrammarError(KVStrataError):
    """A constraint was fed a token it does not allow (a bug in the caller's loop)."""


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` objects against one tokenizer (thread-safe).

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's vocabulary:
    the extra ids are never allowed). ``eos_token_id`` is the token a finished grammar allows.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        import llguidance.hf

        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=eos_token_id
            )
        except ValueError as exc:
            raise ConfigError(f"structured output needs a fast (Rust) tokenizer: {exc}") from exc
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compiled: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, spec: GrammarSpec) -> str:
        """The compiled grammar of ``spec``; :class:`ConfigError` (one line, llguidance's reason)
        if it is invalid. Results are cached, so checking before running costs nothing later."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        from llguidance import LLMatcher

        grammar = spec._llguidance()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            reason = " ".join(" ".join(messages).split())
            what = "JSON schema" if spec.kind is GrammarKind.JSON_SCHEMA else "grammar"
            raise ConfigError(f"invalid {what}: {reason}")
        with self._lock:
            self._compiled[spec] = grammar
            while len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return grammar

    def constraint(self, spec: GrammarSpec) -> Constraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, self.check(spec))
        if matcher.is_error():
            raise ConfigError(f"invalid grammar: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self.eos_token_id)


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_id: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def allowed(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A bool mask over the vocabulary: the tokens the grammar allows next (EOS once the
        grammar is complete and nothing else can follow)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return torch.from_numpy(mask).to(device)

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar does not allow token {token}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the output must end here)."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete sentence of the grammar."""
        return bool(self._matcher.is_accepting())
