"""JSON schemas as the grammar takes them: an object schema that does not say
``additionalProperties`` allows none, as vLLM's default grammar backend (xgrammar) reads it.

Without this a schema such as ``{"type": "object", "properties": {"city": ...}}`` lets the
model add keys of its own after the ones listed, and a small model keeps adding them until
``max_tokens`` cuts the JSON. A schema that wants extra keys says ``"additionalProperties":
true`` (or gives their schema), and gets them.
"""

from __future__ import annotations

import copy
from typing import Any

# keywords whose value maps names to subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords whose value is a subschema or a list of them
_SUBSCHEMAS = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "additionalItems",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
    "items",
    "prefixItems",
    "allOf",
    "anyOf",
    "oneOf",
)


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` in which every object schema with ``properties`` (or
    ``patternProperties``) and no ``additionalProperties`` has ``"additionalProperties": false``."""
    copied = copy.deepcopy(schema)
    _close(copied)
    return copied


def _close(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for sub in value.values():
                _close(sub)
    for key in _SUBSCHEMAS:
        value = node.get(key)
        if isinstance(value, dict | list):
            _close(value)
    if "additionalProperties" not in node and (
        isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    ):
        node["additionalProperties"] = False
