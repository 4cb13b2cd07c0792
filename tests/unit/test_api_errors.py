"""The router's terminal errors reach clients by their kind, and their text stays what records and logs show."""

from __future__ import annotations

import pytest

from kvrelay.api.errors import from_failure
from kvrelay.core.router.events import ErrorKind, RequestError


@pytest.mark.parametrize(
    ("kind", "status", "code", "message"),
    [
        (ErrorKind.NO_WORKER, 503, "no_worker", "model 'x' is not served; served models: a, b"),
        (ErrorKind.NO_CAPACITY, 413, "kv_capacity_exceeded", "model 'x' is not served; served models: a, b"),
        (
            ErrorKind.QUEUE_FULL,
            429,
            "queue_full",
            "kvrelay is overloaded for 'x': model 'x' is not served; served models: a, b; retry in 1 s",
        ),
        (ErrorKind.OVER_CONTEXT_LIMIT, 413, "context_length_exceeded", "model 'x' is not served; served models: a, b"),
        (ErrorKind.GAVE_UP, 500, "internal_error", "the request failed: model 'x' is not served; served models: a, b"),
        (
            ErrorKind.DUPLICATE_REQUEST,
            500,
            "internal_error",
            "the request failed: model 'x' is not served; served models: a, b",
        ),
    ],
)
def test_each_error_kind_has_its_http_status(kind: ErrorKind, status: int, code: str, message: str) -> None:
    error = from_failure(RequestError(kind, "model 'x' is not served; served models: a, b"), "x")
    assert (error.status, error.code, error.message) == (status, code, message)


def test_a_client_facing_kind_prefixes_the_text_and_the_others_keep_their_detail() -> None:
    assert (
        RequestError(ErrorKind.QUEUE_FULL, "4096 requests are waiting", 3).text
        == "queue_full: 4096 requests are waiting"
    )
    assert RequestError(ErrorKind.GAVE_UP, "gave up after 3 attempts: x").text == "gave up after 3 attempts: x"


def test_a_full_queue_is_a_429_whose_retry_after_says_when() -> None:
    error = from_failure(RequestError(ErrorKind.QUEUE_FULL, "the work waiting ahead of it would take 40.0 s", 7), "x")
    assert error.status == 429 and error.headers == {"Retry-After": "7"}
    assert error.body()["error"]["type"] == "rate_limit_error" and "retry in 7 s" in error.message
