"""The parts of OpenAI response bodies built from engine results: choices (a chat message with its
tool calls, or a text), their finish reasons, and log-probabilities in the chat format
(``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``) or the legacy completions
format (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.engine.engine import Response
from kvstrata.engine.sampling import TokenChoice
from kvstrata.server.tools import ToolCall, parse_calls


class TokenText:
    """Token ids to the text OpenAI reports for each (as vLLM does: the token decoded alone, so
    a token holding part of a UTF-8 character reads as the replacement character; or, with
    ``as_ids``, vLLM's ``token_id:ID``)."""

    def __init__(self, tokenizer: Any, *, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if self._as_ids:
            return f"token_id:{token}"
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self._tokenizer.decode([token])
        return text


def chat_logprobs(choices: Sequence[TokenChoice], text_of: TokenText) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(c.token, c.logprob if c.logprob is not None else 0.0),
                "top_logprobs": [entry(t, lp) for t, lp in c.top_logprobs],
            }
            for c in choices
        ]
    }


def text_logprobs(choices: Sequence[TokenChoice], text_of: TokenText, offset: int = 0) -> dict[str, Any]:
    tokens = [text_of(c.token) for c in choices]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [c.logprob for c in choices],
        "top_logprobs": [{text_of(t): lp for t, lp in c.top_logprobs} for c in choices],
        "text_offset": offsets,
    }


def finish_reason(response: Response, calls: Sequence[ToolCall]) -> str:
    """ "tool_calls" when the output is calls (and was not cut short: then "length")."""
    return "tool_calls" if calls and response.finish_reason == "stop" else response.finish_reason


def chat_choice(
    index: int, response: Response, *, reads_calls: bool, text_of: TokenText | None
) -> dict[str, Any]:
    content: str | None = response.text
    calls: list[ToolCall] = []
    if reads_calls:
        content, calls = parse_calls(response.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(response.logprobs, text_of)
        if response.logprobs is not None and text_of is not None
        else None,
        "finish_reason": finish_reason(response, calls),
        "stop_reason": response.stop_reason,
    }


def text_choice(
    index: int, response: Response, *, text_of: TokenText | None, echo: str = ""
) -> dict[str, Any]:
    return {
        "index": index,
        "text": echo + response.text,
        "logprobs": text_logprobs(response.logprobs, text_of)
        if response.logprobs is not None and text_of is not None
        else None,
        "finish_reason": response.finish_reason,
        "stop_reason": response.stop_reason,
    }
