"""schemathesis against the server's own OpenAPI document: no 500, no hang, every 4xx in OpenAI's format naming
the field, every response as the document describes it.

The document comes from a running embedded server (a tiny Gemma 3 model with a
32-token context, so a valid request generates a few dozen tokens at most) with
two pins that only a served model can give: ``model`` is the served model's id,
so valid bodies reach generation, and token ids (in ``prompt`` and ``stop``) are
inside its vocabulary. ``schemathesis run`` (the command a user would run) sends
schema-valid bodies (positive) and schema-violating ones (negative) to every
operation in all its phases, deterministically and bounded by ``EXAMPLES`` per
operation, each request with a timeout, and applies every check it has (status
codes, content types and bodies as documented; valid data accepted, invalid data
rejected; unsupported methods answered 405; no 5xx) plus
``tests.support.openai_error_check``. A valid body may still meet the model's
context limit: a 413 is the one refusal valid data may get.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.server_thread import ServerThread

EXAMPLES = 40
CONTEXT = 32
REQUEST_TIMEOUT_S = 30
MAX_RESPONSE_S = 25
"""A bound on every response, generation included, that a busy two-core machine meets."""
ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "413"]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("schemathesis"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("facts") / "facts.sqlite3"
    with ServerThread(model_dir, f"sqlite:///{db}") as s:
        yield s


def pin_to_model(document: dict[str, Any], model: str, vocab_size: int) -> dict[str, Any]:
    """The document with ``model`` fixed to the served model and every token id inside its vocabulary."""
    schemas = document["components"]["schemas"]
    for name in ("CompletionRequest", "ChatRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [model]}

    def bound(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0:
                node["maximum"] = vocab_size - 1
            for value in node.values():
                bound(value)
        elif isinstance(node, list):
            for value in node:
                bound(value)

    bound(schemas["CompletionRequest"]["properties"]["prompt"])
    for name in ("CompletionRequest", "ChatRequest"):
        bound(schemas[name]["properties"]["stop"])
    return document


@pytest.mark.timeout(900)
def test_the_api_meets_its_own_schema(server: ServerThread, model_dir: Path, tmp_path: Path) -> None:
    assert server.parts is not None
    document = pin_to_model(
        httpx.get(server.base_url + "/openapi.json").json(), model_dir.name, server.parts.served.vocab_size
    )
    (tmp_path / "openapi.json").write_text(json.dumps(document))
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.support.openai_error_check", PYTHONPATH=f"{ROOT / 'src'}:{ROOT}")
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--no-color", "run", str(tmp_path / "openapi.json")]
        + ["--url", server.base_url, "--checks", "all", "--max-examples", str(EXAMPLES)]
        + ["--generation-deterministic", "--workers", "1"]
        + ["--request-timeout", str(REQUEST_TIMEOUT_S), "--max-response-time", str(MAX_RESPONSE_S)]
        + ["--report-dir", str(tmp_path / "report")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    print(run.stdout[-6000:])
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-4000:]
