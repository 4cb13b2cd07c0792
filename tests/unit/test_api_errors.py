"""The router's terminal errors reach clients by their kind, and their text stays what records and logs show."""

from __future__ import annotations

import pytest

from kvrelay.api.errors import from_failure
from kvrelay.core.router.events import ErrorKind, RequestError


@pytest.mark.parametrize(
    ("kind", "status", "code", "message"),
    [
        (ErrorKind.NO_WORKER, 503, "no_worker", "model 'x' is not served; served models: a, b"),
        (ErrorKind.NO_CAPACITY, 429, "no_capacity", "every worker serving 'x' is at capacity; retry later"),
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
        RequestError(ErrorKind.NO_CAPACITY, "waited 60.0 s for a worker").text
        == "no_capacity: waited 60.0 s for a worker"
    )
    assert RequestError(ErrorKind.GAVE_UP, "gave up after 3 attempts: x").text == "gave up after 3 attempts: x"
