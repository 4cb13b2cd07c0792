"""The OpenAPI document of the HTTP API, from the same structs the server decodes and encodes.

Contract:
- ``COMPONENTS`` holds the JSON schemas of the request bodies (``api.schema``) and the
  response bodies (``api.responses``), under ``#/components/schemas/<name>``.
- ``request_body(kind)`` and ``responses(...)`` are the per-route documentation that
  ``api.app`` hands to FastAPI: the routes read their bodies themselves, so FastAPI
  documents no body and no 422 of its own; every error status is documented with
  OpenAI's error body.
- ``describe(kind, param)`` is the description of the field at the dotted path ``param``
  of request ``kind`` (``messages.0.role``), or of the nearest field above it that has
  one, for error messages.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvrelay.api.responses import SCHEMAS
from kvrelay.api.schema import ChatRequest, CompletionRequest

REF = "#/components/schemas/{name}"
REQUESTS: tuple[type[msgspec.Struct], ...] = (CompletionRequest, ChatRequest)

_STRING_PROMPT: dict[str, Any] = {"type": "string", "minLength": 1}
_PROMPT_FORMS: list[dict[str, Any]] = [
    _STRING_PROMPT,
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    {"type": "array", "items": _STRING_PROMPT, "minItems": 1, "maxItems": 1},
]
"""What ``prompt`` accepts, exactly: a string, token ids, or an array of one string (decoding admits any mix,
which ``Ingress.prepare_completion`` then rejects)."""


def _components() -> dict[str, Any]:
    _, components = msgspec.json.schema_components((*REQUESTS, *SCHEMAS), ref_template=REF)
    components["CompletionRequest"]["properties"]["prompt"]["anyOf"] = _PROMPT_FORMS
    return components


COMPONENTS: dict[str, Any] = _components()

STATUS_TEXT = {
    400: "a malformed body or an invalid field (param names it)",
    404: "the model is not served",
    413: "the body, or the prompt with max_tokens, is larger than the model's context or any worker's KV",
    429: "the router queue is full; the Retry-After header says in how many seconds to retry",
    500: "the request failed inside the server",
    503: "no live worker serves the model now (after a router start, none registered yet: see Retry-After)",
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(name=name)}


def request_body(kind: type[msgspec.Struct]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``kind``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref(kind.__name__)}}}}


def responses(ok: dict[str, Any], errors: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """A route's documented responses: ``ok`` (the 200's content) and each error status with OpenAI's body."""
    documented: dict[int | str, dict[str, Any]] = {200: {"description": "success", "content": ok}}
    for status in errors:
        documented[status] = {
            "description": STATUS_TEXT[status],
            "content": {"application/json": {"schema": ref("ErrorBody")}},
        }
    if 429 in errors:
        retry_after = {"description": "whole seconds to wait before retrying", "schema": {"type": "integer"}}
        documented[429]["headers"] = {"Retry-After": retry_after}
    return documented


def describe(kind: type[msgspec.Struct], param: str) -> tuple[str, str] | None:
    """The description of the field at ``param`` in request ``kind`` (``messages.0.role``), or of the nearest
    field above it that has one: (that field's path, its description); None when none has."""
    node: dict[str, Any] = ref(kind.__name__)
    found: tuple[str, str] | None = None
    parts = param.split(".")
    for depth, part in enumerate(parts):
        node = _resolve(node)
        if part.isdigit():
            node = (_branch(node, "items") or {}).get("items", {})
        else:
            node = (_branch(node, "properties") or {}).get("properties", {}).get(part, {})
        description = node.get("description") or _resolve(node).get("description")
        if isinstance(description, str):
            found = (".".join(parts[: depth + 1]), description)
    return found


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = COMPONENTS[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _branch(node: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``node`` itself, or the first branch of its ``anyOf`` that has ``key``."""
    if key in node:
        return node
    for option in node.get("anyOf", ()):
        option = _resolve(option)
        if key in option:
            return option
    return None
