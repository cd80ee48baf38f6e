"""What a request becomes before it runs: its prompt's token ids and its decoder.

Built on the caller's thread, so a request that cannot run (an empty prompt, ids outside the
vocabulary, an invalid grammar, a stop token outside the vocabulary) is refused before anything
is written.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.engine.decoder import RequestDecoder
from kvstrata.engine.grammar import GrammarCompiler
from kvstrata.engine.requests import GenerationRequest
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.model import LoadedModel


class RequestPreparer:
    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        eos = model.model.generation_config.eos_token_id
        if eos is None:
            eos = model.tokenizer.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.vocab_size = int(model.model.get_input_embeddings().weight.shape[0])
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles the grammars of constrained requests (built on first use: about 0.3 s)."""
        if self._grammars is None:
            eos = min(self.stop_ids) if self.stop_ids else self.model.tokenizer.eos_token_id
            self._grammars = GrammarCompiler(self.model.tokenizer, self.vocab_size, eos)
        return self._grammars

    def decoder(self, request: GenerationRequest, prompt_ids: Sequence[int] = ()) -> RequestDecoder:
        params = request.params
        return RequestDecoder(
            params,
            self.model.tokenizer,
            eos_token_ids=self.stop_ids,
            vocab_size=self.vocab_size,
            grammars=self.grammars if params.grammar is not None else None,
            prompt_ids=prompt_ids,
        )

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self.model.tokenizer
        if request.prompt_ids is not None:
            vocab = self.vocab_size
            bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise ConfigError(f"prompt_ids holds ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
            if not request.prompt_ids:
                raise ConfigError("the prompt is empty")
            return list(request.prompt_ids)
        if request.messages is not None:
            extra = {**(request.template_kwargs or {})}  # vLLM's chat_template_kwargs
            if request.tools:
                extra["tools"] = list(request.tools)
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
