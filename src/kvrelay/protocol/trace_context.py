"""W3C trace context (https://www.w3.org/TR/trace-context/): the ``traceparent`` a request's spans hang from.

A ``traceparent`` is ``VERSION-TRACE_ID-PARENT_ID-FLAGS`` in lower-case hex (2, 32, 16 and 2 digits). The
ingress accepts one from the client's HTTP request and the router carries one in every offer
(``Offer.traceparent``), so the spans the router and the worker export belong to the client's trace.
A value that does not parse is ignored, as the recommendation says: the request starts a trace of its own.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

_PATTERN = r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}"
_TRACEPARENT = re.compile(_PATTERN)

TraceParent = Annotated[str, msgspec.Meta(pattern=f"^(|{_PATTERN})$")]
"""A ``traceparent`` on the wire, or ``""`` for none."""


def parse_traceparent(text: str | None) -> str | None:
    """``text`` stripped when it is a usable ``traceparent`` (version 00 to fe, non-zero trace and parent ids),
    else None."""
    if not text:
        return None
    text = text.strip()
    if _TRACEPARENT.fullmatch(text) is None:
        return None
    version, trace_id, parent_id, _ = text.split("-")
    if version == "ff" or trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return text
