"""The request bodies of the Responses API, as OpenAI defines them (plus vLLM's ``cache_salt``,
``top_k`` and ``repetition_penalty``), and its input items.

As for chat completions, an unknown field is a 400 that names it. Input items are read one by one
(:func:`parse_item`) so that an item the server cannot take is refused with its place in the
input (``input.3.type``): messages (with or without ``"type": "message"``), ``function_call``
and ``function_call_output``; ``reasoning`` items are taken and dropped (the models served do not
reason); hosted tools' items (web search, computer use, ...) are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvstrata.server.errors import APIError
from kvstrata.server.schemas import ReasoningEffort, ServiceTier

MAX_ID_CHARS = 200


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Item(BaseModel):
    # items that come back from OpenAI's own outputs carry fields of no use here (status, phase,
    # annotations, logprobs, provider data): taken and ignored
    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Item):
    type: Literal["refusal"]
    refusal: str


def _text_parts(value: Any) -> Any:
    if isinstance(value, list):
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text", "refusal"):
                raise ValueError(
                    f"content part {index} has type {kind!r}, which is not supported: the model served "
                    "here reads text only (input_text, output_text)"
                )
    return value


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart | RefusalPart]
    id: str | None = None

    _parts = field_validator("content", mode="before")(_text_parts)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None

    _parts = field_validator("output", mode="before")(_text_parts)

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningItem(_Item):
    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def parse_item(index: int, raw: Any) -> InputItem | None:
    """Input item ``index``; None for one that is dropped (reasoning). APIError (400) if it is
    not an item this server takes."""
    where = f"input.{index}"
    if not isinstance(raw, dict):
        raise APIError(400, f"{where}: an input item is an object", param=where, code="invalid_value")
    kind = raw.get("type", "message" if "role" in raw else None)
    model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        supported = ", ".join(_ITEM_TYPES)
        raise APIError(
            400,
            f"{where}: input items of type {kind!r} are not supported (supported: {supported})",
            param=f"{where}.type",
            code="unsupported_value",
        )
    try:
        item = model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in (where, *first.get("loc", ())))
        reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise APIError(400, f"{loc}: {reason}", param=loc, code="invalid_value") from exc
    return None if isinstance(item, ReasoningItem) else item  # type: ignore[return-value]


class FunctionTool(_Strict):
    type: str
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _functions_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"tool type {value!r} is not supported (only 'function' tools: no hosted tools)")
        return value

    def as_chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "output", "schema": self.json_schema or {"type": "object"}}
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted; the models served have no notion of it."""


class Reasoning(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted; the models served do not reason."""


class ConversationRef(_Strict):
    id: str


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool = False
    """Accepted; no obfuscation padding is sent (the server is not behind OpenAI's network)."""


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    conversation: str | ConversationRef | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    background: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_tool_calls: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # vLLM's extensions
    cache_salt: str | None = Field(default=None, min_length=1)
    top_k: int = Field(default=0, ge=-1)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None

    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation
