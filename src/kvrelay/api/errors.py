"""Errors in OpenAI's error format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any, assert_never

from kvrelay.core.router.events import ErrorKind, RequestError


class APIError(Exception):
    """An HTTP error with an OpenAI-style body; ``param`` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}
        """HTTP headers of the error response (a 429's ``Retry-After``)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def from_failure(failure: RequestError, model: str) -> APIError:
    """Map the router's terminal error to an HTTP error by its kind."""
    match failure.kind:
        case ErrorKind.NO_WORKER:
            return APIError(503, failure.detail, "service_unavailable", "model", "no_worker")
        case ErrorKind.NO_CAPACITY:
            return APIError(413, failure.detail, "invalid_request_error", "max_tokens", "kv_capacity_exceeded")
        case ErrorKind.QUEUE_FULL:
            retry = failure.retry_after_s or 1
            message = f"kvrelay is overloaded for '{model}': {failure.detail}; retry in {retry} s"
            return APIError(429, message, "rate_limit_error", None, "queue_full", {"Retry-After": str(retry)})
        case ErrorKind.OVER_CONTEXT_LIMIT:
            return APIError(413, failure.detail, "invalid_request_error", "messages", "context_length_exceeded")
        case ErrorKind.SHUTTING_DOWN:
            return APIError(503, failure.detail, "service_unavailable", None, "shutting_down")
        case ErrorKind.GAVE_UP | ErrorKind.DUPLICATE_REQUEST:
            return APIError(500, f"the request failed: {failure.text}", "server_error", None, "internal_error")
        case _:
            assert_never(failure.kind)
