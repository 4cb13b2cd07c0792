"""The codec round-trips every wire message and rejects bad frames with a clear error."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvrelay.protocol.codec import ProtocolError, decode, encode
from kvrelay.protocol.messages import (
    Assignment,
    Cancel,
    Delta,
    Heartbeat,
    Offer,
    OfferResult,
    Residency,
    Result,
    RouteSegment,
    Sampling,
    Timings,
    Usage,
)
from kvrelay.protocol.trace_context import parse_traceparent

A = Assignment("req-1", 2)

SAMPLES = [
    Offer(
        assignment=A,
        worker_id="w0",
        epoch=3,
        model="m",
        model_fingerprint="ab",
        prompt=(1, 2, 3),
        max_new_tokens=8,
        generated_before=1,
        sampling=Sampling(temperature=0.7, seed=9, stop_token_ids=(1,)),
        route=(RouteSegment("gpu", 2), RouteSegment("object", 1, "bucket")),
        chain=(b"k" * 16,),
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ),
    Cancel(assignment=A, worker_id="w0", reason="consumer"),
    OfferResult(assignment=A, worker_id="w0", epoch=3, accepted=False, reason="no_capacity"),
    Delta(assignment=A, worker_id="w0", seq=4, tokens=(5, 6)),
    Result(
        assignment=A,
        worker_id="w0",
        tokens=(5, 6),
        finish_reason="length",
        usage=Usage(prompt_tokens=3, cached_tokens={"gpu": 64}, recomputed_tokens=3, generated_tokens=2),
        timings=Timings(ttft_s=0.1, inter_token_s=(0.01,)),
    ),
    Heartbeat(
        worker_id="w0",
        epoch=3,
        seq=10,
        models=("m",),
        pages_total=100,
        pages_free=50,
        restore_bytes_per_s={"ram": 1e10},
    ),
    Residency(worker_id="w0", epoch=3, seq=11, tier="ssd", stored=(b"a" * 16,), removed=(b"b" * 16,)),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert decode(encode(message)) == message


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode(7), "invalid message"),
        (msgspec.msgpack.encode({"type": "launch_missiles"}), "'launch_missiles'"),
        (msgspec.msgpack.encode({"type": "cancel", "v": 99, "assignment": ["a", 1], "worker_id": "w"}), "version 99"),
        (msgspec.msgpack.encode({"type": "cancel", "assignment": ["a", 1]}), "worker_id"),
        (msgspec.msgpack.encode({"type": "cancel", "assignment": ["a", "one"], "worker_id": "w"}), "assignment"),
        (msgspec.msgpack.encode({"type": "cancel", "assignment": ["a", 0], "worker_id": "w"}), ">= 1"),
        (
            msgspec.msgpack.encode(
                {"type": "residency", "worker_id": "w", "epoch": 1, "seq": 1, "tier": "ram", "stored": [b"x" * 4096]}
            ),
            "length <= 32",
        ),
        (
            msgspec.msgpack.encode(
                {
                    "type": "offer_result",
                    "assignment": ["a", 1],
                    "worker_id": "w",
                    "epoch": 1,
                    "accepted": False,
                    "reason": "felt_like_it",
                }
            ),
            "reason",
        ),
    ],
)
def test_rejects_bad_frames(frame: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        decode(frame)


def test_an_offer_of_an_older_router_without_traceparent_decodes_with_none() -> None:
    offer = SAMPLES[0]
    assert isinstance(offer, Offer)
    fields = msgspec.msgpack.decode(encode(offer))
    del fields["traceparent"]
    assert decode(msgspec.msgpack.encode(fields)) == msgspec.structs.replace(offer, traceparent="")


def test_an_offer_with_a_malformed_traceparent_is_rejected() -> None:
    fields = msgspec.msgpack.decode(encode(SAMPLES[0]))
    fields["traceparent"] = "00-not-a-trace-01"
    with pytest.raises(ProtocolError, match="traceparent"):
        decode(msgspec.msgpack.encode(fields))


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        (
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", None),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", None),
        ("", None),
        (None, None),
    ],
)
def test_a_clients_traceparent_is_used_only_when_it_parses(header: str | None, parsed: str | None) -> None:
    assert parse_traceparent(header) == parsed


def test_rejects_oversized_frames() -> None:
    frame = encode(SAMPLES[0])
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(frame, max_frame_bytes=len(frame) - 1)


@pytest.mark.parametrize(
    "local_only",
    [object(), torch.zeros(2), ("timer", "r", 1)],
    ids=["handle", "tensor", "timer-tuple"],
)
def test_rejects_local_only_values(local_only: object) -> None:
    with pytest.raises(ProtocolError, match="local-only"):
        encode(local_only)  # type: ignore[arg-type]


def test_rejects_tensor_inside_message() -> None:
    with pytest.raises(ProtocolError, match="local-only"):
        encode(Delta(assignment=A, worker_id="w", seq=0, tokens=torch.tensor([1, 2])))  # type: ignore[arg-type]


def test_rejects_mistyped_field_on_encode() -> None:
    with pytest.raises(ProtocolError, match="invalid message"):
        encode(Delta(assignment=A, worker_id="w", seq=-1, tokens=(1,)))
