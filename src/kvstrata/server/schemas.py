"""Request bodies the server accepts, as the OpenAI API defines them (plus vLLM's extensions:
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``top_k``, ``repetition_penalty``,
``cache_salt``, ``chat_template_kwargs``). Unknown fields are refused (400), not silently ignored:
a client asking for something this server does not do (audio output, predicted outputs) must
learn so. Fields that mean nothing for the models served here (``service_tier`` beyond the
priority it maps to, ``reasoning_effort``, chat ``store``) are accepted and documented as such in
docs/agents.md. Content parts other than text are refused with a clear message: the models served
are text-only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Strict):
    """One part of a message's content; only text parts are served (see ChatMessage)."""

    type: Literal["text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """A clear refusal of the parts a text-only model cannot read (instead of a union error)."""
    if isinstance(content, list):
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content part {index} has type {kind!r}, which is not supported: the model served "
                    "here reads text only (parts of type 'text')"
                )
    return content


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's calls."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""
    refusal: str | None = None

    _parts = field_validator("content", mode="before")(_text_parts_only)

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs tool_call_id (and only a tool message has one)")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: str
    function: FunctionDefinition

    @field_validator("type")
    @classmethod
    def _function_tools(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"tool type {value!r} is not supported (only 'function' tools)")
        return value


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# the keyword arguments the server itself gives the chat template
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize", "return_dict"}
)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: usage in every chunk (accepted; kvstrata reports it in the last one)."""


class GenerationParams(_Strict):
    """The fields chat and text completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions, which benchmark clients send
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False
    """Logprobs name tokens ``token_id:ID`` (tokens that are part of a character are otherwise
    ambiguous)."""
    top_k: int = Field(default=0, ge=-1)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (as a string) -> bias in [-100, 100], added to the token's score."""
    prompt_cache_key: str | None = None
    """OpenAI's cache key; here it names the session when no ``X-Session-Id`` does."""
    cache_salt: str | None = Field(default=None, min_length=1)
    """vLLM's: requests with different salts never share KV (here: a namespace of its own)."""
    service_tier: ServiceTier | None = None
    """``flex`` runs as ``background``, ``priority`` as ``realtime`` (when no ``X-Priority``)."""
    safety_identifier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are in [-100, 100], got {bias} for token {token}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is None:
            return None
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids are >= 0")
        return value


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None
    """OpenAI keeps such completions for its dashboard; accepted, nothing more is kept here."""
    reasoning_effort: ReasoningEffort | None = None
    """Accepted; the models served do not reason."""
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or {}))
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: set by the server, not by chat_template_kwargs")
        return value


class CompletionRequest(GenerationParams):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    """The legacy API's: how many top tokens to report per position (the chosen one besides)."""
    echo: bool = False
    """The text starts with the prompt (not with ``logprobs``: the prompt's are not computed)."""


class CreateSessionRequest(_Strict):
    id: str
    priority: str | None = None
    ttl_s: float | None = Field(default=None, gt=0)
    pinned: bool = False


class ForkRequest(_Strict):
    id: str


class PriorityRequest(_Strict):
    priority: str


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
