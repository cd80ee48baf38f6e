"""Tool calling in the Hermes format: how tools are described to the model, how its calls and
their results are written into the conversation, the grammar that forces a call, and the
parser that reads calls back out of the whole output (while it streams:
:mod:`kvstrata.server.call_stream`).

The format is the one Hermes-2-Pro and Qwen 2.5/3 models are trained on and that vLLM's
``hermes`` tool parser reads: tools are listed as JSON inside ``<tools></tools>`` in the system
prompt, a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, a result is
a ``tool`` turn holding ``<tool_response>\\n...\\n</tool_response>``. A chat template that
renders tools itself gets them through ``apply_chat_template(tools=...)`` instead
(:mod:`kvstrata.server.chat`); the calls are read back the same way.

KV reuse across an agent's tool loop depends on one property: a call the model generated must
render, when the agent sends it back, as the very text it was generated as. So the arguments a
response carries are the exact JSON text the model wrote (not re-serialised), and
:func:`render_calls` writes them back verbatim into the same wrapper the grammar forces.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.grammar import JSON_OPTIONS, GrammarSpec
from kvstrata.server.schema_defaults import closed_objects

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
# the wrapper the grammar forces (and render_calls writes): name first, then the arguments' text
_WRAPPER_RE = re.compile(
    r'\A\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*?)\s*\}\s*\Z', re.DOTALL
)

SYSTEM_PROMPT = """# Tools

You can call functions to help with the user's request. Their signatures are listed as JSON \
inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments inside \
<tool_call></tool_call> tags, one call per block:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call read from the output; ``arguments`` is JSON text, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- the prompt side ------------------------------------------------------------------------------


def system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool section of the system prompt: one JSON line per tool (keys in a fixed order, so
    the same tools always render the same tokens and an agent's system prompt stays cached)."""
    lines = [json.dumps({"type": "function", "function": t["function"]}, ensure_ascii=False) for t in tools]
    return SYSTEM_PROMPT.format(tools="\n".join(lines))


def render_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """Tool calls (OpenAI's ``{"function": {"name", "arguments"}}``) as the model writes them."""
    return "\n".join(f"{CALL_OPEN}\n{_call_json(c['function'])}\n{CALL_CLOSE}" for c in calls)


def render_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _call_json(function: Mapping[str, Any]) -> str:
    arguments = function.get("arguments") or "{}"
    try:
        json.loads(arguments)
    except (TypeError, ValueError):
        arguments = json.dumps(arguments, ensure_ascii=False)  # not JSON: written as a string
    return f'{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "arguments": {arguments}}}'


# -- the grammar ----------------------------------------------------------------------------------


def call_grammar(
    tools: Sequence[Mapping[str, Any]], *, parallel: bool = True, or_json: Mapping[str, Any] | None = None
) -> GrammarSpec:
    """Output that is one tool call (``parallel``: one or more) of ``tools``, each call's
    arguments valid against the tool's parameters schema. ``or_json``: a JSON schema the output
    may instead satisfy (a response format when calls are optional)."""
    bodies = [
        f"tool_{i}: %json {json.dumps(_call_schema(tool['function']), ensure_ascii=False)}"
        for i, tool in enumerate(tools)
    ]
    calls = 'call ("\\n" call)*' if parallel else "call"
    start = f"start: {calls}" if or_json is None else f"start: {calls} | answer"
    rules = [
        start,
        f'call: "{_lark_text(CALL_OPEN)}\\n" body "\\n{_lark_text(CALL_CLOSE)}"',
        "body: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
        *bodies,
    ]
    if or_json is not None:
        rules.append(f"answer: %json {json.dumps(_with_options(dict(or_json)), ensure_ascii=False)}")
    return GrammarSpec.lark("\n".join(rules))


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    params = closed_objects(dict(function.get("parameters") or {"type": "object"}))
    # $defs stay at the root, where the parameters' "#/$defs/..." references point
    defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    schema = {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **defs,
    }
    return _with_options(schema)


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_OPTIONS}


def _lark_text(text: str) -> str:
    return json.dumps(text)[1:-1]


# -- reading calls back ---------------------------------------------------------------------------


def parse_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content before the first call (None if blank) and the calls in ``text``. A block
    that is not a call (invalid JSON, no name) leaves the whole text as content, as vLLM does;
    except an unclosed last block after complete calls (the output was cut by ``max_tokens``),
    which is dropped."""
    start = text.find(CALL_OPEN)
    if start == -1:
        return (text or None), []
    calls = []
    for match in _CALL_RE.finditer(text, start):
        call = parse_call(match.group(1))
        if call is None:
            if calls and match.end() == len(text) and not match.group(0).endswith(CALL_CLOSE):
                break
            return text, []
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


def parse_call(block: str, call_id: str | None = None) -> ToolCall | None:
    """The call in one ``<tool_call>`` block (None if it is not one), with ``call_id`` or a new id."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    raw = _WRAPPER_RE.match(block)
    if raw is not None and _same_json(raw.group(2), arguments):
        text = raw.group(2)  # the model's own text: it renders back to the same tokens
    else:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call_id or new_call_id(), value["name"], text)


def _same_json(text: str, value: Any) -> bool:
    try:
        return bool(json.loads(text) == value)
    except ValueError:
        return False
