"""Request bodies from bytes: a size bound checked before the body is read whole, and strict JSON decoding
whose every failure is a 400 in OpenAI's format naming the field and the fix.

Contract:
- ``body_limit(context_limits)`` is the most bytes a body may have: ``BODY_BYTES_PER_TOKEN``
  per token of the largest served context plus ``BODY_OVERHEAD_BYTES``; no prompt that fits
  a context comes near it (English text is about 4 bytes a token, JSON-escaped CJK about
  12), so a larger body cannot be a prompt. ``read_body`` answers 413 from the
  ``Content-Length`` header alone when it says more, and stops reading a streamed body as
  soon as it passes the bound.
- ``decode_body(raw, kind)`` returns the ``kind`` struct or raises ``APIError`` (400):
  not JSON (``param`` is the field the error sits in, from ``json_path_at``), invalid
  UTF-8, a lone UTF-16 surrogate, nesting too deep to decode, or a field of the wrong
  type or out of range (``param`` is its dotted path, ``messages.0.role``; the message
  says what the field must be, from its description).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from starlette.requests import Request

from kvrelay.api.errors import APIError, invalid

T = TypeVar("T")
Describe = Callable[[str], tuple[str, str] | None]
"""The contract of the field at a dotted path: (the path of the field described, its description)."""

BODY_BYTES_PER_TOKEN = 64
BODY_OVERHEAD_BYTES = 64 * 1024

_LONE_SURROGATE = re.compile(
    rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F][0-9a-fA-F]{2}"
)
"""Escaped backslashes, surrogate pairs and surrogate escapes: a match of the last kind alone is a lone surrogate."""
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[\[\]{},:]')
_MSGSPEC_PATH = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def body_limit(context_limits: Iterable[int]) -> int:
    """The byte bound of a request body for models with these context limits (see the module contract)."""
    return BODY_BYTES_PER_TOKEN * max(context_limits, default=0) + BODY_OVERHEAD_BYTES


def too_large(size: int | None, limit: int) -> APIError:
    said = f"has {size:,} bytes" if size is not None else "goes on past that"
    return APIError(
        413,
        f"the request body {said}; this server accepts bodies of at most {limit:,} bytes, more than any prompt "
        "that fits the served models' context; send a shorter prompt (the server's --max-body-bytes sets the bound)",
        "invalid_request_error",
        None,
        "request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 at once when ``Content-Length`` is over ``limit``, or when the bytes pass it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(None, limit)
    return bytes(body)


def decode_body(raw: bytes, kind: type[T], describe: Describe) -> T:
    """``raw`` decoded as ``kind``; ``APIError`` 400 otherwise. ``describe(param)`` is the field's contract."""
    if not raw.strip():
        raise invalid('the request body is empty; send a JSON object such as {"model": ..., ...}')
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise _invalid_field(str(exc), describe) from None
    except msgspec.DecodeError as exc:
        raise _not_json(raw, str(exc)) from None
    except RecursionError:
        field = (json_path_at(raw, _deep_offset(raw)) or "").split(".")[0] or None
        raise invalid(
            f"{f'`{field}`' if field else 'the body'} nests arrays or objects too deeply to decode; "
            "no field of a request nests more than a few levels",
            field,
        ) from None


def _invalid_field(text: str, describe: Describe) -> APIError:
    match = _MSGSPEC_PATH.match(text)
    assert match is not None  # the pattern matches every string
    message, path = match["message"], match["path"] or ""
    parts = [name or index for name, index in _PATH_PART.findall(path)]
    missing = _MISSING.match(message)
    if missing:
        parts.append(missing["field"])
        message = "the field is required"
    param = ".".join(parts) or None
    message = re.sub(r"`[^`]*`", lambda m: re.sub(r"\w+", lambda w: _JSON_TYPES.get(w[0], w[0]), m[0]), message)
    contract = describe(param) if param else None
    rule = f". `{contract[0]}`: {contract[1]}" if contract else ""
    return invalid(f"invalid {f'`{param}`' if param else 'body'}: {message[:1].lower()}{message[1:]}{rule}", param)


def _not_json(raw: bytes, text: str) -> APIError:
    for match in _LONE_SURROGATE.finditer(raw):
        if len(match[0]) == 6:
            return invalid(
                f"the text at byte {match.start()} holds a lone UTF-16 surrogate ({match[0].decode()}), which "
                "is not valid Unicode; escape each character outside the BMP as a surrogate pair, or send it as UTF-8",
                json_path_at(raw, match.start()),
            )
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return invalid(
            f"the body is not valid UTF-8 (byte {exc.start}); send the JSON encoded as UTF-8",
            json_path_at(raw, exc.start),
        )
    if "truncated" in text:
        return invalid(f"the body ends inside its JSON value after {len(raw):,} bytes; send the whole JSON object")
    detail = text.removeprefix("JSON is malformed: ")
    at = re.search(r"\(byte (\d+)\)$", detail)
    offset = int(at[1]) if at else None
    detail = detail[: at.start()].rstrip() + f" at byte {offset}" if at else detail
    return invalid(f"the body is not valid JSON: {detail}", json_path_at(raw, offset) if offset is not None else None)


def json_path_at(raw: bytes, offset: int) -> str | None:
    """The dotted path of the value that byte ``offset`` of the JSON text ``raw`` lies in (None: the top level).

    A scan of ``raw``'s strings and punctuation up to ``offset``; it needs no valid JSON
    after the offset, so it names where a syntax error sits.
    """
    stack: list[list[str | int | None]] = []  # per open container: [key or index, awaiting a key?]
    for token in _TOKENS.finditer(raw, 0, offset):
        text = token[0]
        if text in (b"{", b"["):
            stack.append([None, True] if text == b"{" else [0, False])
        elif text in (b"}", b"]"):
            if stack:
                stack.pop()
        elif not stack:
            continue
        elif text == b",":
            top = stack[-1]
            if isinstance(top[0], int) and not top[1]:
                top[0] += 1
            else:
                top[1] = True
        elif text == b":":
            stack[-1][1] = False
        elif stack[-1][1]:  # a string where an object awaits a key
            stack[-1][0] = _string(text)
            stack[-1][1] = False
    names = [str(top[0]) for top in stack if top[0] is not None]
    return ".".join(names) or None


def _string(token: bytes) -> str:
    try:
        value = msgspec.json.decode(token if token.endswith(b'"') and len(token) > 1 else token + b'"')
    except msgspec.DecodeError:
        return token.strip(b'"').decode("utf-8", "replace")
    return value if isinstance(value, str) else str(value)


def _deep_offset(raw: bytes, depth: int = 64) -> int:
    """The offset where ``raw``'s nesting first reaches ``depth`` (or its end)."""
    level = 0
    for token in _TOKENS.finditer(raw):
        if token[0] in (b"{", b"["):
            level += 1
            if level >= depth:
                return token.start()
        elif token[0] in (b"}", b"]"):
            level -= 1
    return len(raw)
