"""The vLLM worker without an engine: KV events to chunk keys and epochs, /metrics figures, admission, bodies."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from kvrelay.engines.vllm import kv_events
from kvrelay.engines.vllm.admission import EngineCapacity, EngineIdentity, admit_offer, block_demand
from kvrelay.engines.vllm.client import EngineClient, parse_chunk, request_body
from kvrelay.engines.vllm.host import VllmWorker, attempt_seed
from kvrelay.engines.vllm.identity import EngineModelError, engine_fingerprint, kv_bytes_per_token
from kvrelay.engines.vllm.metrics import EngineFigures, MetricsError, parse_metrics
from kvrelay.engines.vllm.served import ServedFit, ServedSpeeds
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.protocol.chunk_keys import chunk_chain, prompt_chain, root_key
from kvrelay.protocol.messages import Assignment, FinishReason, Offer, Residency, RouteSegment, Sampling
from kvrelay.testing.tiny_models import make_tiny_model

FP = b"vllm-fp-16-bytes"
BS = 4
DATA = Path(__file__).resolve().parents[1] / "data"


def frame(seq: int, *events: dict) -> list[bytes]:
    """A multipart frame as vLLM's ZmqEventPublisher sends it: topic, 8-byte seq, msgpack [ts, events, rank]."""
    payload = msgspec.msgpack.encode([1.5, list(events), 0])
    return [b"", seq.to_bytes(8, "big"), payload]


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, **extra: object) -> dict:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens}
    event.update({"block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None})
    event.update({"extra_keys": [None] * len(hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention"})
    event.update(extra)
    return event


def mirror() -> kv_events.BlockMirror:
    return kv_events.BlockMirror(root_key(FP), BS)


def apply(m: kv_events.BlockMirror, parts: list[bytes]) -> kv_events.MirrorChange:
    _, batch = kv_events.decode_frame(parts)
    return kv_events.apply_batch(m, batch.events)


def test_stored_blocks_become_the_routers_chain_keys() -> None:
    tokens = list(range(100, 112))  # three blocks of four
    m = mirror()
    first = apply(m, frame(0, stored([11, 12], tokens[:8])))
    second = apply(m, frame(1, stored([13], tokens[8:], parent=12)))
    chain = chunk_chain(FP, tokens, BS)
    assert first.stored == chain[:2] and second.stored == chain[2:]
    assert prompt_chain(FP, [*tokens, 7], BS) == chain  # a prompt one token longer: the same routable chain
    assert set(m.keys) == set(chain)


def test_removal_counts_copies_and_clear_reports_everything() -> None:
    tokens = list(range(8))
    m = mirror()
    apply(m, frame(0, stored([1, 2], tokens)))
    apply(m, frame(1, stored([2], tokens[4:], parent=1)))  # the same block hash stored twice
    chain = chunk_chain(FP, tokens, BS)
    once = apply(m, frame(2, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}))
    assert once.removed == () and chain[1] in m.keys
    twice = apply(m, frame(3, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}))
    assert twice.removed == (chain[1],)
    cleared = apply(m, frame(4, {"type": "AllBlocksCleared"}))
    assert cleared.cleared and cleared.removed == (chain[0],) and not m.keys


def test_stored_then_removed_in_one_batch_nets_to_nothing() -> None:
    m = mirror()
    change = apply(m, frame(0, stored([1], [1, 2, 3, 4]), {"type": "BlockRemoved", "block_hashes": [1]}))
    assert change == kv_events.MirrorChange()


@pytest.mark.parametrize(
    "event",
    [
        stored([5], [1, 2, 3, 4], parent=999),  # a parent the mirror never saw
        stored([5], [1, 2, 3, 4], medium="CPU"),
        stored([5], [1, 2, 3, 4], group_idx=1, kv_cache_spec_kind="sliding_window"),
        stored([5], [1, 2, 3, 4], group_idx=1, kv_cache_spec_kind=None),  # no kind: group 0 only
        stored([5], [1, 2, 3, 4], lora_name="adapter"),
        stored([5], [1, 2, 3, 4], extra_keys=[("salt",)]),
        stored([5], [1, 2, 3, 4, 5, 6, 7, 8], block_size=8),
    ],
)
def test_blocks_that_are_not_the_chains_are_skipped(event: dict) -> None:
    m = mirror()
    assert apply(m, frame(0, event)).stored == () and m.skipped == 1 and not m.keys


def test_the_mirror_follows_the_full_attention_group_of_a_sliding_window_model() -> None:
    """Gemma 3 on vLLM: groups 0-4 sliding-window (blocks near the prompt's end only), group 5 full attention.
    The chain comes from group 5 whole; group 0's stores, with parents it never stored, and its removals of the
    same hashes change nothing."""
    tokens = list(range(100, 116))  # four blocks of four
    sliding = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
    m = mirror()
    first = apply(
        m,
        frame(
            0,
            stored([3, 4], tokens[8:], parent=2, group_idx=0, **sliding),
            stored([1, 2, 3, 4], tokens, group_idx=5, kv_cache_spec_kind="full_attention"),
        ),
    )
    chain = chunk_chain(FP, tokens, BS)
    assert first.stored == chain and m.skipped == 2
    gone = apply(m, frame(1, {"type": "BlockRemoved", "block_hashes": [3, 4], "group_idx": 0}))
    assert gone == kv_events.MirrorChange() and set(m.keys) == set(chain)
    tail = apply(m, frame(2, {"type": "BlockRemoved", "block_hashes": [4], "group_idx": 5}))
    assert tail.removed == (chain[3],)


def test_malformed_frames_raise() -> None:
    with pytest.raises(kv_events.KvEventError):
        kv_events.decode_frame([b"", b"\x00"])
    with pytest.raises(kv_events.KvEventError):
        kv_events.decode_frame([b"", (0).to_bytes(8, "big"), b"\xc1"])


@pytest.mark.parametrize(
    ("last", "seq", "kind"),
    [(None, 7, "first"), (3, 4, "next"), (3, 6, "gap"), (3, 3, "restarted"), (9, 0, "restarted")],
)
def test_continuity(last: int | None, seq: int, kind: str) -> None:
    assert kv_events.continuity(last, seq).value == kind


def test_metrics_of_a_real_exposition() -> None:
    text = (DATA / "vllm_metrics.txt").read_text()
    figures = parse_metrics(text)
    assert (figures.num_blocks, figures.block_size, figures.running, figures.prefix_hits) == (64, 64, 0, 512)
    busy = text.replace('vllm:num_requests_running{engine="0",model_name="/tmp/vt/tiny-vllm"} 0.0', "")
    busy += 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    busy += 'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
    figures = parse_metrics(busy)
    assert (figures.running, figures.kv_usage, figures.used_blocks) == (2, 0.25, 16)
    with pytest.raises(MetricsError):
        parse_metrics('vllm:num_requests_running{engine="0"} 1.0\n')


@pytest.mark.parametrize(("label", "tokens"), [("0", 0), ("128", 128), ("None", 64), (None, None), ("x", None)])
def test_metrics_read_the_prefix_cache_checkpoint_interval(label: str | None, tokens: int | None) -> None:
    """The real exposition says 0 (vLLM 0.32's default); ``None`` (dense) is a checkpoint every block; an
    exposition without the label (an older vLLM) says nothing."""
    text = (DATA / "vllm_metrics.txt").read_text()
    real = 'prefix_cache_retention_interval="0",'
    assert real in text
    assert parse_metrics(text).checkpoint_tokens == 0
    edited = text.replace(real, "" if label is None else f'prefix_cache_retention_interval="{label}",')
    assert parse_metrics(edited).checkpoint_tokens == tokens


def test_metrics_read_the_speed_histograms_summed_over_engines() -> None:
    text = (DATA / "vllm_metrics.txt").read_text()
    for engine in ("0", "1"):
        labels = f'{{engine="{engine}",model_name="m"}}'
        for name, value in (
            ("vllm:request_prefill_time_seconds", (1.5, 3.0)),
            ("vllm:request_prefill_kv_computed_tokens", (4000.0, 3.0)),
        ):
            text += f"# HELP {name} h\n# TYPE {name} histogram\n"
            text += f'{name}_bucket{{engine="{engine}",le="+Inf",model_name="m"}} {value[1]}\n'
            text += f"{name}_sum{labels} {value[0]}\n{name}_count{labels} {value[1]}\n"
    totals = parse_metrics(text).totals
    assert (totals.prefill_requests, totals.prefill_seconds, totals.prefill_tokens) == (6.0, 3.0, 8000.0)


ME = EngineIdentity("v1", 5, "m", FP, context_limit=64, block_tokens=BS)
PROMPT = tuple(range(1, 14))  # 13 tokens: three cacheable blocks


def offer(**kw: object) -> Offer:
    fields: dict = dict(
        assignment=Assignment("r", 1), worker_id="v1", epoch=5, model="m", model_fingerprint=FP.hex(), prompt=PROMPT
    )
    fields.update(max_new_tokens=3)
    fields.update(kw)
    return Offer(**fields)


ROOMY = EngineCapacity(total_blocks=16, used_blocks=0, promised_blocks=0)


@pytest.mark.parametrize(
    ("kw", "capacity", "up", "reason"),
    [
        ({"epoch": 4}, ROOMY, True, "wrong_epoch"),
        ({"model": "x"}, ROOMY, True, "wrong_model"),
        ({"model_fingerprint": "00", "chain": prompt_chain(b"00", PROMPT, BS)[:1]}, ROOMY, True, "wrong_model"),
        ({"chain": (b"\x01" * 16,)}, ROOMY, True, "wrong_model"),
        ({}, ROOMY, False, "shutting_down"),
        ({"max_new_tokens": 60}, ROOMY, True, "over_context_limit"),
        ({"route": (RouteSegment("gpu", 2),)}, ROOMY, True, "stale_route"),
        ({}, EngineCapacity(16, used_blocks=13, promised_blocks=2), True, "no_capacity"),
        ({}, EngineCapacity(16, used_blocks=1, promised_blocks=13), True, "no_capacity"),
    ],
)
def test_declines_name_the_reason(kw: dict, capacity: EngineCapacity, up: bool, reason: str) -> None:
    result = admit_offer(ME, offer(**kw), capacity, {}, up)
    assert not result.accepted and result.reason == reason and result.detail


def test_admission_shares_the_resident_prefix_and_serves_foreign_recompute_offers() -> None:
    chain = prompt_chain(FP, PROMPT, BS)
    held = {chain[0]: 1, chain[1]: 2}
    warm = admit_offer(ME, offer(route=(RouteSegment("gpu", 2),), chain=chain[:2]), ROOMY, held, True)
    assert warm.accepted and warm.prefix_chunks == 2 and warm.demand_blocks == block_demand(13, 3, 2, BS) == 2
    tight = EngineCapacity(16, used_blocks=14, promised_blocks=0)
    assert admit_offer(ME, offer(), tight, held, True).accepted  # 4 blocks minus the 2 resident fit in 2 free
    foreign = admit_offer(ME, offer(model_fingerprint="ab" * 16), ROOMY, {}, True)
    assert foreign.accepted and foreign.prefix_chunks == 0  # a mixed cluster's recompute offer


def test_request_body_and_chunks() -> None:
    sampling = Sampling(temperature=0.7, top_p=0.9, top_k=0, seed=3, stop_token_ids=(1,))
    body = request_body("served", (5, 6), 8, sampling, attempt_seed(3, 0))
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 8 and body["return_token_ids"] and body["ignore_eos"]
    assert body["top_k"] == -1 and body["stop_token_ids"] == [1] and body["stream_options"] == {"include_usage": True}
    assert attempt_seed(3, 0) == attempt_seed(3, 0) != attempt_seed(3, 4) and 0 <= attempt_seed(3, 0) < 2**63
    token = parse_chunk({"choices": [{"index": 0, "text": "a", "token_ids": [9, 10], "finish_reason": None}]})
    assert token is not None and token.tokens == (9, 10) and token.finish_reason is None
    last = parse_chunk({"choices": [{"token_ids": [4], "finish_reason": "length"}]})
    assert last is not None and last.finish_reason is FinishReason.LENGTH
    usage = parse_chunk({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 128}}})
    assert usage is not None and usage.cached_tokens == 128 and not usage.tokens
    assert parse_chunk({"choices": [{"text": "", "token_ids": [], "finish_reason": None}]}) is None


def worker_host() -> tuple[VllmWorker, list[Residency]]:
    published: list[Residency] = []
    identity = EngineIdentity("v1", 5, "m", FP, context_limit=64, block_tokens=BS)
    figures = EngineFigures(num_blocks=16, block_size=BS)
    host = VllmWorker(identity, EngineClient("http://127.0.0.1:9"), "served", 64, 4, figures, published.append)
    return host, published


def test_lost_or_cleared_kv_events_start_a_new_epoch_and_forget_the_mirror() -> None:
    async def scenario() -> None:
        host, published = worker_host()
        host.on_kv_frame(frame(3, stored([1, 2], list(range(8)))))  # the first frame seen may have any seq
        assert len(host.mirror.keys) == 2 and published[-1].stored and host.epoch == 5
        host.on_kv_frame(frame(4, stored([3], list(range(8, 12)), parent=2)))
        assert host.epoch == 5 and len(host.mirror.keys) == 3
        host.on_kv_frame(frame(6, stored([4], [1, 1, 1, 1])))  # seq 5 was lost: removals may be missing
        gap_epoch = host.epoch
        assert gap_epoch > 5 and list(host.mirror.keys) == [chunk_chain(FP, [1, 1, 1, 1], BS)[0]]
        assert published[-1].epoch == gap_epoch and host.heartbeat().epoch == gap_epoch
        host.on_kv_frame(frame(7, {"type": "AllBlocksCleared"}))
        assert host.epoch > gap_epoch and not host.mirror.keys
        host.on_kv_frame(frame(0, stored([9], [2, 2, 2, 2])))  # a restarted publisher
        restarted = host.epoch
        assert restarted > gap_epoch + 1 and len(host.mirror.keys) == 1
        host.on_disconnect("ws://router")  # a lost router link keeps the mirror and publishes it again
        assert host.epoch > restarted and len(host.mirror.keys) == 1
        count = len(published)
        host.heartbeat()
        await asyncio.sleep(0)
        assert len(published) == count + 1 and set(published[-1].stored) == set(host.mirror.keys)
        assert published[-1].epoch == host.epoch
        await host.engine.close()

    asyncio.run(scenario())


def test_an_unreachable_engine_declines_and_reports_no_free_blocks_until_it_is_back() -> None:
    async def scenario() -> None:
        host, _ = worker_host()
        host.on_figures(None)
        assert not host.engine_up and host.epoch > 5 and host.heartbeat().pages_free == 0
        down_epoch = host.epoch
        replies: list[object] = []
        host.on_offer(offer(epoch=down_epoch), replies.append)
        assert replies and not replies[0].accepted and replies[0].reason == "shutting_down"  # type: ignore[attr-defined]
        host.on_figures(EngineFigures(num_blocks=16, block_size=BS, kv_usage=0.25))
        assert host.engine_up and host.epoch > down_epoch and host.heartbeat().pages_free == 12
        await host.engine.close()

    asyncio.run(scenario())


def test_a_run_that_ends_gives_its_blocks_back_before_the_next_metrics_poll() -> None:
    async def scenario() -> None:
        host, _ = worker_host()
        host.on_figures(EngineFigures(num_blocks=16, block_size=BS, kv_usage=0.75))  # 12 of 16 blocks in use
        replies: list[object] = []
        host.on_offer(offer(max_new_tokens=3), replies.append)  # 13 + 3 tokens: 4 blocks
        assert replies[0].accepted and host.heartbeat().pages_free == 4  # type: ignore[attr-defined]
        # The engine at port 9 is unreachable, so the run ends with an error and is released.
        await asyncio.wait_for(until(lambda: not host.runs), 5.0)
        assert host.heartbeat().pages_free == 8, "the ended run's 4 blocks are free before vLLM's figures say so"
        host.on_figures(EngineFigures(num_blocks=16, block_size=BS, kv_usage=0.75))  # newer figures are the truth
        assert host.heartbeat().pages_free == 4
        await host.engine.close()

    asyncio.run(scenario())


async def until(done: Callable[[], bool]) -> None:
    """Return once ``done()`` holds (the caller bounds the wait)."""
    while not done():
        await asyncio.sleep(0.01)


def test_each_accepted_offer_counts_the_runs_before_it_and_the_heartbeat_reports_their_price() -> None:
    async def scenario() -> None:
        host, _ = worker_host()
        replies: list[object] = []
        for k in range(3):
            host.on_offer(offer(assignment=Assignment(f"r{k}", 1), max_new_tokens=1), replies.append)
        assert [r.accepted for r in replies] == [True] * 3  # type: ignore[attr-defined]
        assert [run.in_flight for run in host.runs.values()] == [0, 1, 2]
        engine_fit = host.speeds.engine
        served = ServedFit()
        for k in range(12):  # what each request in flight cost a first token: 25 ms
            tokens = 100 + 400 * (k % 3)
            served = served.point(tokens, 0.01 + 1e-5 * tokens + 0.025 * (k % 4), k % 4)
        host.speeds = ServedSpeeds(engine_fit, served, served_at=host.clock())
        beat = host.heartbeat()
        assert beat.per_request_s == pytest.approx(0.025) == host.speeds.per_request_s
        for run in list(host.runs.values()):
            if run.task is not None:
                run.task.cancel()
        await host.engine.close()

    asyncio.run(scenario())


def test_a_vllm_fingerprint_never_equals_a_native_one_and_names_engine_dtype_and_block(tmp_path: Path) -> None:
    model = make_tiny_model("llama", tmp_path / "tiny", head_dim=32)
    native = load_artifacts(model, torch.float32).fingerprint
    base = engine_fingerprint(model, "0.32.0", "float32", 64)
    assert base == engine_fingerprint(model, "0.32.0", "float32", 64) != native
    others = {engine_fingerprint(model, "0.33.0", "float32", 64), engine_fingerprint(model, "0.32.0", "bfloat16", 64)}
    others.add(engine_fingerprint(model, "0.32.0", "float32", 32))
    assert base not in others and len(others) == 3
    assert kv_bytes_per_token(model, "float32") == 2 * 2 * 2 * 32 * 4
    with pytest.raises(EngineModelError, match="config.json"):
        engine_fingerprint(tmp_path, "0.32.0", "float32", 64)
