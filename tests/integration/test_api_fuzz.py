"""Every body the ingress accepts makes an offer that survives the wire codec (a cluster sends it as msgpack).

Bodies come from hypothesis strategies derived from the request schemas (their
JSON schemas in ``api.openapi.COMPONENTS``): a body satisfying the schema, then
up to two fields left out or replaced by values at or past their edges (huge and
negative numbers, unicode and lone surrogates, token ids outside the vocabulary,
stop lists mixing ints and strings, ``n``) or by junk of any JSON type; unknown
fields and non-object bodies are thrown in too. Each is decoded and prepared by
the ingress of an embedded server with a tiny model directly (over HTTP the
schemathesis run of ``test_api_schemathesis`` fuzzes the same bodies). The run
is derandomized (the same examples every time) and bounded to ``EXAMPLES`` bodies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.api.errors import APIError
from kvrelay.api.openapi import COMPONENTS
from kvrelay.protocol.codec import decode, encode
from kvrelay.protocol.messages import Assignment, Offer
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.server_thread import ServerThread

EXAMPLES = 150
CONTEXT = 96
VOCAB = 384

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JUNK = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)
"""Any JSON value, nested: what a broken client might send in place of a field."""
TEXT = st.text(max_size=16)
ODD_TEXT = st.one_of(
    st.text(max_size=64),
    st.text(st.characters(exclude_categories=()), max_size=8),
    st.sampled_from(
        [
            "",
            "\U0001f600 caf\u00e9 \u4e2d\u6587",
            "\x00",
            "<eos>",
            "<start_of_turn>user\n",
            "\ufffd",
            "\u200b" * 40,
            "\ud800",
            "a\udfffb",
        ]
    ),
)
"""Odd text, lone UTF-16 surrogates included (JSON can spell them; they are not valid Unicode)."""
EDGE_INTS = st.sampled_from([0, -1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30)])
EDGE_FLOATS = st.sampled_from([0.0, 1e-300, 1e-8, 1e300, -1.0, 2.5, -0.0])
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
ODD_TOKEN_IDS = st.lists(
    st.one_of(st.integers(0, VOCAB - 1), st.integers(-5, -1), st.integers(VOCAB, VOCAB + 5), EDGE_INTS), max_size=12
)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return defs[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node


def valid_value(node: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that satisfy the JSON-schema ``node`` (its type, bounds, enum and item count); numbers stay small."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        return st.one_of(*(valid_value(option, defs) for option in node["anyOf"]))
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "string":
        return TEXT
    if kind == "integer":
        if "minimum" in node:
            return st.integers(node["minimum"], node["minimum"] + 24)
        return st.one_of(st.integers(-3, 24), EDGE_INTS)
    if kind == "number":
        low, high = node.get("minimum", node.get("exclusiveMinimum", -2.0)), node.get("maximum", 2.0)
        return st.floats(low, high, exclude_min="exclusiveMinimum" in node)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = valid_value(node["items"], defs) if node.get("items") else JSON_SCALARS
        return st.lists(items, min_size=node.get("minItems", 0), max_size=3)
    if kind == "object":
        return valid_object(node, defs, {})
    return JSON_SCALARS


def odd_value(node: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values at or past the edges of ``node``: its type with extreme or odd contents, or junk of another type."""
    node = _resolve(node, defs)
    kinds = [_resolve(o, defs).get("type") for o in node["anyOf"]] if "anyOf" in node else [node.get("type")]
    edges: list[st.SearchStrategy[Any]] = [JUNK]
    if "string" in kinds:
        edges.append(ODD_TEXT)
    if "integer" in kinds:
        edges.append(EDGE_INTS)
    if "number" in kinds:
        edges.append(EDGE_FLOATS)
    if "array" in kinds:
        edges.append(st.lists(JUNK, max_size=4))
    if "object" in kinds:
        edges.append(st.dictionaries(st.text(max_size=8), JUNK, max_size=3))
    return st.one_of(*edges)


def valid_object(
    node: dict[str, Any], defs: dict[str, Any], hints: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """Objects satisfying ``node``: every required field, some optional ones; ``hints`` override by field name."""
    props = node.get("properties", {})
    required = set(node.get("required", ()))
    field = {k: hints.get(k, valid_value(sub, defs)) for k, sub in props.items()}
    return st.fixed_dictionaries(
        {k: v for k, v in field.items() if k in required},
        optional={k: v for k, v in field.items() if k not in required},
    )


def mutated_object(
    node: dict[str, Any], defs: dict[str, Any], hints: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """A valid object with up to two fields replaced by odd values or removed, and maybe an unknown field added."""
    props = node.get("properties", {})

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body = draw(valid_object(node, defs, hints))
        for key in draw(st.lists(st.sampled_from(sorted(props)), max_size=2, unique=True)):
            if draw(st.integers(0, 4)) == 0:
                body.pop(key, None)
            else:
                body[key] = draw(odd_value(props[key], defs))
        if draw(st.integers(0, 5)) == 0:
            body[draw(st.text(min_size=1, max_size=8))] = draw(JUNK)
        return body

    return build()


def request_bodies(model: str) -> st.SearchStrategy[tuple[str, Any]]:
    """(path, body) pairs for both endpoints, from their schemas; a few bodies are not even objects."""
    hints = {
        "model": st.one_of(st.just(model), st.just(model), st.just(model), st.sampled_from(["gpt-4o", model.upper()])),
        "prompt": st.one_of(TEXT.filter(bool), TOKEN_IDS, st.lists(TEXT.filter(bool), min_size=1, max_size=1)),
        "max_tokens": st.one_of(st.integers(1, 24), st.integers(1, 24), st.integers(1, 24), st.just(CONTEXT)),
        "max_completion_tokens": st.one_of(st.integers(1, 24), st.integers(1, 24), st.just(CONTEXT)),
        "n": st.just(1),
    }
    schemas = {"/v1/completions": COMPONENTS["CompletionRequest"], "/v1/chat/completions": COMPONENTS["ChatRequest"]}
    odd_prompts = st.fixed_dictionaries(
        {"model": st.just(model), "prompt": st.one_of(ODD_TOKEN_IDS, ODD_TEXT)},
        optional={"max_tokens": st.integers(1, 8), "stream": st.booleans()},
    )
    odd_numbers = st.fixed_dictionaries(
        {"model": st.just(model), "prompt": TEXT.filter(bool), "max_tokens": st.integers(1, 4)},
        optional={
            "seed": st.one_of(EDGE_INTS, st.integers()),
            "stop": st.lists(st.one_of(EDGE_INTS, st.integers(-2, VOCAB + 2), TEXT), max_size=4),
            "temperature": st.one_of(EDGE_FLOATS, st.floats(0.0, 2.0)),
            "top_p": EDGE_FLOATS,
        },
    )
    typed = [st.tuples(st.just(path), mutated_object(schema, COMPONENTS, hints)) for path, schema in schemas.items()]
    garbage = st.tuples(st.sampled_from(sorted(schemas)), JUNK)
    return st.one_of(
        *typed, *typed, st.tuples(st.just("/v1/completions"), st.one_of(odd_prompts, odd_numbers)), garbage
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("fuzz-gemma3"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("facts") / "facts.sqlite3"
    with ServerThread(model_dir, f"sqlite:///{db}") as s:
        yield s


def test_every_body_the_ingress_accepts_is_encodable_on_the_wire(server: ServerThread, model_dir: Path) -> None:
    """In a cluster the router sends each request to a worker as msgpack: nothing the ingress accepts may break that."""
    assert server.parts is not None
    ingress = server.parts.ingress
    accepted = 0

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(request_bodies(model_dir.name))
    def prepare(case: tuple[str, Any]) -> None:
        nonlocal accepted
        path, body = case
        try:
            raw = json.dumps(body).encode()
            _, prepared = ingress._completion(raw) if path == "/v1/completions" else ingress._chat(raw)
        except APIError:
            return
        accepted += 1
        offer = Offer(
            assignment=Assignment("r", 1),
            worker_id="w",
            epoch=1,
            model=prepared.model.name,
            prompt=tuple(prepared.prompt),
            max_new_tokens=prepared.max_tokens,
            sampling=prepared.sampling,
        )
        assert decode(encode(offer)) == offer, body

    prepare()
    assert accepted >= EXAMPLES // 10
