"""schemathesis hooks for the API (``SCHEMATHESIS_HOOKS=tests.support.openai_error_check``).

- The check ``openai_errors``: every 4xx is OpenAI's error body, and a 400 about a
  JSON object body names a field of the request in ``param``.
- ``map_body`` writes integral numbers as JSON integers: JSON Schema counts 5.0 as
  an integer and cannot say otherwise, but kvrelay, like OpenAI, reads a number with
  a fraction as a decimal, not as ``max_tokens`` 5.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis import Case, CheckContext, HookContext, Response

REQUESTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatRequest"}


@schemathesis.check
def openai_errors(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    if not 400 <= response.status_code < 500:
        return None
    body = json.loads(response.content)
    assert isinstance(body, dict) and set(body) == {"error"}, f"not OpenAI's error body: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"not OpenAI's error fields: {error}"
    assert isinstance(error["message"], str) and error["message"], f"no message: {error}"
    assert isinstance(error["type"], str) and error["type"], f"no type: {error}"
    assert error["param"] is None or isinstance(error["param"], str), f"param is not a string: {error}"
    kind = REQUESTS.get(case.operation.path)
    if response.status_code == 400 and kind and isinstance(case.body, dict):
        fields = set(case.operation.schema.raw_schema["components"]["schemas"][kind]["properties"]) | set(case.body)
        param = error["param"]
        assert param and param.split(".")[0] in fields, f"param names no field of the body: {error}"
    return True


@schemathesis.hook
def map_body(context: HookContext, body: Any) -> Any:
    return _integers(body)


def _integers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: _integers(v) for k, v in value.items()}
    return value
