"""Request bodies the server accepts. Unknown fields are refused (400), not silently ignored:
a client asking for ``tools`` or ``top_p`` must learn that this server does not do them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationParams(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    n: Literal[1] = 1
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(GenerationParams):
    prompt: str = Field(min_length=1)


class CreateSessionRequest(_Strict):
    id: str
    priority: str | None = None
    ttl_s: float | None = Field(default=None, gt=0)
    pinned: bool = False


class ForkRequest(_Strict):
    id: str


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
