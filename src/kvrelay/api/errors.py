"""Errors in OpenAI's error format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An HTTP error with an OpenAI-style body; ``param`` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def from_outcome_error(error: str, model: str) -> APIError:
    """Map the router's terminal error (``no_worker: ...``, ``no_capacity: ...``, ...) to an HTTP error."""
    kind = error.split(":", 1)[0]
    if kind == "no_worker":
        return APIError(503, error.split(": ", 1)[-1], "service_unavailable", "model", "no_worker")
    if kind == "no_capacity":
        return APIError(
            429, f"every worker serving '{model}' is at capacity; retry later", "rate_limit_error", None, "no_capacity"
        )
    if kind == "over_context_limit":
        return APIError(413, error.split(": ", 1)[-1], "invalid_request_error", "messages", "context_length_exceeded")
    return APIError(500, f"the request failed: {error}", "server_error", None, "internal_error")
