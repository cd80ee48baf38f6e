"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (text, as completions tokenise it) or ``messages`` (a chat, as
chat completions render it: the same roles, tools and chat template, so the count is the prompt a
chat request would send) and answers ``{"count", "max_model_len", "tokens"}`` (with
``token_strs`` when ``return_token_strs``). ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool

from kvstrata.server.chat import prepare_chat
from kvstrata.server.context import ServerContext
from kvstrata.server.deps import context, require_tenant
from kvstrata.server.errors import APIError
from kvstrata.server.schemas import RESERVED_TEMPLATE_KWARGS, ChatCompletionRequest, ChatMessage, Tool

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    """Default: True for a prompt (as completions), False for messages (the template adds them)."""
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or {}))
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: set by the server, not by chat_template_kwargs")
        return value


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids are >= 0")
        return value


def _check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None and not ctx.config.serves(model):
        raise APIError(404, f"model {model!r} is not served here", param="model", code="model_not_found")


def _vocab_size(ctx: ServerContext) -> int:
    return int(ctx.engine.model.model.get_input_embeddings().weight.shape[0])


def _tokenize(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
    tokenizer = ctx.engine.model.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt", code="invalid_value")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return [int(t) for t in tokenizer(body.prompt, add_special_tokens=special)["input_ids"]]
    chat_body = ChatCompletionRequest(
        model=body.model or ctx.config.model_name, messages=body.messages or [], tools=body.tools
    )
    chat = prepare_chat(chat_body, tokenizer)
    extra: dict[str, Any] = {**(body.chat_template_kwargs or {})}
    if chat.template_tools:
        extra["tools"] = chat.template_tools
    try:
        if body.add_special_tokens:
            text = tokenizer.apply_chat_template(
                chat.messages, add_generation_prompt=body.add_generation_prompt, tokenize=False, **extra
            )
            return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]
        # as the engine renders a chat request's prompt
        encoded = tokenizer.apply_chat_template(
            chat.messages, add_generation_prompt=body.add_generation_prompt, tokenize=True, **extra
        )
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"the chat template failed: {exc}", param="messages") from exc
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


@router.post("/tokenize")
async def tokenize(
    body: TokenizeRequest, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    ctx = context(request)
    _check_model(ctx, body.model)
    ids = await run_in_threadpool(_tokenize, ctx, body)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.config.max_prompt_tokens, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = ctx.engine.model.tokenizer.convert_ids_to_tokens(ids)
    return answer


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest, request: Request, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    ctx = context(request)
    _check_model(ctx, body.model)
    vocab = _vocab_size(ctx)
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise APIError(
            400,
            f"tokens outside the vocabulary (0..{vocab - 1}): {bad[:5]}",
            param="tokens",
            code="invalid_value",
        )
    return {"prompt": ctx.engine.model.tokenizer.decode(body.tokens)}
