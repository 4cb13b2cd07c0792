"""The worker-local controller on a tiny real Gemma 3: streaming, prefix reuse, exact cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from kvrelay.core.worker.speeds import heartbeat_speeds
from kvrelay.models.batch import ForwardBatch
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.protocol.messages import OfferResult, Result, RouteSegment
from kvrelay.testing.tiny_models import make_tiny_model
from kvrelay.worker.runtime import loop as runtime_loop
from kvrelay.worker.runtime.warmup import measure_speeds
from tests.support.bench_smoke import run_bench
from tests.support.step_models import RecordingModel
from tests.support.worker_harness import WorkerHarness

PROMPT = tuple(range(5, 5 + 150))  # 2 full chunks + 22 tokens
WAIT_FOR_FOLLOWERS_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("tiny-gemma3"))


def run(model_dir: Path, body: Callable[[WorkerHarness], Awaitable[None]], **kw: object) -> None:
    async def main() -> None:
        harness = WorkerHarness(model_dir, **kw)  # type: ignore[arg-type]
        try:
            await body(harness)
        finally:
            harness.close()

    asyncio.run(main())


def test_streams_deltas_and_one_result_equal_to_the_runtime_alone(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        expected = h.reference(PROMPT, 12)
        offer, replies = h.offer("r1", PROMPT, 12)
        result = await replies.wait_for(Result)
        accepted = replies.messages[0]
        assert isinstance(accepted, OfferResult) and accepted.accepted
        assert [d.seq for d in replies.deltas] == list(range(len(replies.deltas)))
        assert replies.tokens == expected == list(result.tokens)
        assert result.finish_reason == "length"
        assert result.usage.prompt_tokens == 150 and result.usage.generated_tokens == 12
        assert result.usage.recomputed_tokens == 150 and result.timings.ttft_s > 0
        assert len(result.timings.inter_token_s) == 11
        await h.quiesce()
        h.pool.check()
        assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0

    run(model_dir, body)


def test_a_later_request_reuses_the_cached_prefix_and_gets_the_same_tokens(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        _, first = h.offer("r1", PROMPT, 8)
        cold = await first.wait_for(Result)
        await h.quiesce()
        stored = [m for m in h.published if m.stored]
        assert stored, "the prompt's chunks were announced as gpu residency"
        _, second = h.offer("r2", PROMPT, 8, route=(RouteSegment("gpu", 2),))
        warm = await second.wait_for(Result)
        assert warm.tokens == cold.tokens
        assert warm.usage.cached_tokens == {"gpu": 128} and warm.usage.recomputed_tokens == 22
        await h.quiesce()
        h.pool.check()

    run(model_dir, body)


def test_cancel_during_decode_stops_deltas_and_releases_after_quiescence(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        offer, replies = h.offer("r1", PROMPT, 200)
        await replies.wait_tokens(3)
        h.cancel(offer)
        sent_at_fence = len(replies.deltas)
        await h.quiesce()
        assert len(replies.deltas) == sent_at_fence, "no delta after the fence"
        assert not replies.of(Result)
        h.pool.check()
        assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0
        assert h.pool.num_cached >= 8, "the filled prompt chunks stay resident as cache"
        _, again = h.offer("r2", PROMPT, 4, route=(RouteSegment("gpu", 2),))
        warm = await again.wait_for(Result)
        assert warm.usage.cached_tokens.get("gpu") == 128

    run(model_dir, body)


def test_cancel_before_the_offer_arrives_drops_the_late_offer(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        from kvrelay.protocol.messages import Assignment, Cancel

        h.controller.on_cancel(Cancel(assignment=Assignment("r1", 1), worker_id="w0"))
        _, replies = h.offer("r1", PROMPT, 4)
        assert replies.messages == []
        await h.quiesce()
        h.pool.check()
        assert h.pool.num_free == h.pool.num_pages

    run(model_dir, body)


def test_cancel_twice_and_cancel_racing_completion(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        offer, replies = h.offer("r1", PROMPT, 2)
        await replies.wait_tokens(1)
        h.cancel(offer)
        h.cancel(offer)
        await h.quiesce()
        assert len(replies.of(Result)) <= 1
        h.pool.check()
        assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0

    run(model_dir, body)


def test_admits_until_decline_and_every_admitted_request_finishes_its_budget(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        admitted = []
        for i in range(20):
            prompt = tuple(range(100 + i * 7, 100 + i * 7 + 40 + 9 * i))
            _, replies = h.offer(f"r{i}", prompt, 30)
            answer = await replies.wait_for(OfferResult)
            if not answer.accepted:
                assert answer.reason == "no_capacity"
                break
            admitted.append(replies)
        assert 2 <= len(admitted) < 20
        for replies in admitted:
            result = await replies.wait_for(Result, timeout=60)
            assert result.finish_reason == "length" and len(result.tokens) == 30
        await h.quiesce()
        h.pool.check()

    run(model_dir, body, num_pages=24)


def test_waiting_offers_run_in_the_order_of_their_priority(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        _, running = h.offer("running", PROMPT, 20)  # priority 0: runs first, then holds the only lane
        _, low = h.offer("low", tuple(range(300, 340)), 4, priority=5.0)
        _, high = h.offer("high", tuple(range(400, 440)), 4, priority=1.0)
        await low.wait_for(Result)
        assert high.of(Result), "the later offer of lower priority value ran first"
        assert (await running.wait_for(Result)).finish_reason == "length"
        await h.quiesce()

    run(model_dir, body, lanes=1)


def cold_chunks(model_dir: Path) -> tuple[list[int], dict]:
    """Run PROMPT cold on a fresh worker; return its tokens and the KV of its two full chunks."""
    from tests.support.restore_double import capture

    captured: dict = {}
    tokens: list[int] = []

    async def body(h: WorkerHarness) -> None:
        _, replies = h.offer("cold", PROMPT, 8)
        tokens.extend((await replies.wait_for(Result)).tokens)
        await h.quiesce()
        for key in (m.stored[0] for m in h.published if m.stored):
            (pages,) = h.pool.resident_prefix([key]) or [None]
            if pages is not None:
                captured[key] = capture(h.kv, pages)

    run(model_dir, body)
    return tokens, captured


def test_restored_prefix_gives_the_cold_answer_and_usage_by_tier(model_dir: Path) -> None:
    from tests.support.restore_double import KnownKVRestore

    cold_tokens, chunks = cold_chunks(model_dir)
    assert len(chunks) == 2

    async def body(h: WorkerHarness) -> None:
        h.controller.restorer = KnownKVRestore(h.kv, chunks, "ssd")
        _, replies = h.offer("r", PROMPT, 8, route=(RouteSegment("ssd", 2),))
        result = await replies.wait_for(Result)
        assert list(result.tokens) == cold_tokens
        assert result.usage.cached_tokens == {"ssd": 128} and result.usage.recomputed_tokens == 22
        await h.quiesce()
        h.pool.check()

    run(model_dir, body)


def test_cancel_during_a_slow_restore_releases_only_after_the_copy_finished(model_dir: Path) -> None:
    from tests.support.restore_double import KnownKVRestore

    _, chunks = cold_chunks(model_dir)

    async def body(h: WorkerHarness) -> None:
        restore = KnownKVRestore(h.kv, chunks)
        restore.gate.clear()
        h.controller.restorer = restore
        offer, replies = h.offer("r", PROMPT, 8, route=(RouteSegment("ram", 2),))
        assert await asyncio.to_thread(restore.started.wait, 10)
        h.cancel(offer)
        assert h.pool.num_reserved > 0, "pages under an in-flight restore are not released at the fence"
        restore.log.append("cancelled")
        restore.gate.set()
        await h.quiesce()
        restore.log.append("released")
        assert restore.log == ["restore_started", "cancelled", "restore_done", "released"]
        assert not replies.deltas and not replies.of(Result)
        h.pool.check()
        assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0
        assert h.pool.num_cached == 8, "the restored chunks stay resident as cache"

    run(model_dir, body)


def test_a_slow_restore_does_not_stall_a_running_decode(model_dir: Path) -> None:
    from tests.support.restore_double import KnownKVRestore

    _, chunks = cold_chunks(model_dir)

    async def body(h: WorkerHarness) -> None:
        restore = KnownKVRestore(h.kv, chunks)
        restore.gate.clear()
        h.controller.restorer = restore
        _, decoding = h.offer("busy", tuple(range(300, 340)), 40)
        await decoding.wait_tokens(1)
        _, restoring = h.offer("r", PROMPT, 4, route=(RouteSegment("ram", 2),))
        assert await asyncio.to_thread(restore.started.wait, 10)
        done = await decoding.wait_for(Result)
        assert len(done.tokens) == 40, "the other lane decoded to its budget while the restore was held"
        assert not restoring.deltas
        restore.gate.set()
        assert (await restoring.wait_for(Result)).usage.cached_tokens == {"ram": 128}

    run(model_dir, body)


def test_cancel_during_prefill(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        long_prompt = tuple(i % 250 + 4 for i in range(900))
        offer, replies = h.offer("r", long_prompt, 4)
        await replies.wait_for(OfferResult)
        h.cancel(offer)
        await h.quiesce()
        assert not replies.of(Result)
        h.pool.check()
        assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0

    run(model_dir, body, num_pages=96)


LEADER = tuple(5 + (i * 37) % 250 for i in range(1000))  # 15 full chunks + 40 tokens: four 256-token steps
FOLLOWERS = [LEADER[:960] + tuple(5 + (i * 11 + 7 * j) % 250 for j in range(50)) for i in range(1, 4)]


def test_followers_share_the_prefix_their_leader_is_computing(model_dir: Path) -> None:
    """Offered before the leader's first token, each follower waits for the leader, re-matches its 15 chunks
    and computes its own 50 tokens; its tokens are those of its prompt alone. Without sharing it recomputes."""

    async def follow(h: WorkerHarness) -> list[Result]:
        expected = [h.reference(p, 6) for p in FOLLOWERS]
        _, leader = h.offer("leader", LEADER, 6)
        followers = [h.offer(f"f{i}", p, 6)[1] for i, p in enumerate(FOLLOWERS)]
        results = [await r.wait_for(Result, timeout=60) for r in followers]
        await leader.wait_for(Result, timeout=60)
        assert [list(r.tokens) for r in results] == expected
        await h.quiesce()
        h.pool.check()
        assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0
        return results

    async def shared(h: WorkerHarness) -> None:
        for r in await follow(h):
            assert r.usage.cached_tokens == {"gpu": 960} and r.usage.recomputed_tokens == 50

    async def alone(h: WorkerHarness) -> None:
        for r in await follow(h):
            assert r.usage.cached_tokens == {} and r.usage.recomputed_tokens == 1010

    run(model_dir, shared, num_pages=512)
    run(model_dir, alone, num_pages=512, share_prefill=False)


def test_a_follower_joins_the_forward_right_after_its_leaders_first_token(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device thread holds the forward after the leader's first token until the waiting follower is
    submitted, so the follower's 50 tokens go in that forward, ahead of a longer prompt offered after it
    (without the hold that forward takes the long prompt's chunk alone and the follower waits a forward more).
    The hold's bound is raised so a slow host loop cannot make this test pass or fail by timing."""
    monkeypatch.setattr(runtime_loop, "FOLLOWER_WAIT_S", WAIT_FOR_FOLLOWERS_S)
    other = tuple(5 + (i * 13) % 250 for i in range(700))

    async def body(h: WorkerHarness) -> None:
        recorder = RecordingModel(h.runtime.model)
        h.runtime.model = recorder
        _, leader = h.offer("leader", LEADER, 6)
        _, follower = h.offer("f0", FOLLOWERS[0], 6)
        _, long = h.offer("long", other, 6)
        for replies in (leader, follower, long):
            await replies.wait_for(Result, timeout=60)
        # 256-token budget: the leader's prompt in 256, 256, 256 and 232 tokens (the long one's first 24 beside
        # it); then its first decode row and the follower's 50 tokens, which finish its prompt: the long one's
        # next 205 would more than double that forward, so they wait for the next
        last = recorder.batches.index([232, 24])
        assert recorder.batches[last + 1] == [1, 50]

    run(model_dir, body, num_pages=512)


def test_a_follower_cancelled_while_it_waits_releases_its_pages(model_dir: Path) -> None:
    async def body(h: WorkerHarness) -> None:
        _, leader = h.offer("leader", LEADER, 6)
        waiting, replies = h.offer("f0", FOLLOWERS[0], 6)
        _, other = h.offer("f1", FOLLOWERS[1], 6)
        h.cancel(waiting)  # fenced: the worker sends nothing more for it
        assert (await other.wait_for(Result, timeout=60)).usage.cached_tokens == {"gpu": 960}
        await leader.wait_for(Result, timeout=60)
        await h.quiesce()
        assert replies.of(Result) == [] and replies.deltas == []
        h.pool.check()
        assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0

    run(model_dir, body, num_pages=512)


def test_a_worker_measures_its_speeds_before_it_serves_and_its_heartbeat_reports_them(model_dir: Path) -> None:
    """The start-up measurement replaces the runtime's prior with what a forward costs here, leaves the pool
    as it was, and the heartbeat derives its figures from it (``core.worker.speeds``)."""

    async def body(h: WorkerHarness) -> None:
        free = h.pool.num_free
        speeds = await asyncio.to_thread(measure_speeds, h.runtime, h.artifacts.config.vocab_size, 512)
        assert speeds.prefill_measured and speeds.step_measured and speeds == h.runtime.speeds
        assert speeds.prefill_s_per_token > 0 and speeds.step_s > 0
        assert h.pool.num_free == free and h.pool.num_reserved == 0
        h.pool.check()
        hb = h.controller.heartbeat()
        assert hb.queue_delay_s == 0.0 and hb.decode_s_per_token == speeds.step_s
        assert hb.prefill_s_per_token == heartbeat_speeds(speeds, 0, 0, 256).prefill_s_per_token
        expected = h.reference(PROMPT, 6)  # pages the measurement wrote hold nothing anyone reads
        _, replies = h.offer("r1", PROMPT, 6)
        assert list((await replies.wait_for(Result)).tokens) == expected
        # Its prefill left the queue with its first token: a heartbeat went out then, showing the queue empty.
        assert len(h.heartbeats) == 1 and h.heartbeats[0].queue_delay_s == 0.0 and h.heartbeats[0].seq > hb.seq
        assert h.runtime.speeds != speeds  # it goes on learning from every forward

    run(model_dir, body)


def test_a_stalled_start_up_forward_does_not_set_the_step(model_dir: Path) -> None:
    """A stall in one of the start-up one-token forwards (another worker warming up on the same cores) does not
    become the worker's step, nor the best step it relaxes toward when idle: the step is the least of the
    samples."""
    stall_s = 0.5

    async def body(h: WorkerHarness) -> None:
        hidden = h.runtime.model.hidden
        stalled: list[int] = []

        def stall_first_one_token_forward(batch: ForwardBatch, kv: KVPages) -> torch.Tensor:
            if batch.query_lens == [1] and not stalled:
                stalled.append(1)
                time.sleep(stall_s)  # the forward is this much longer, as a preempted one is
            return hidden(batch, kv)

        h.runtime.model.hidden = stall_first_one_token_forward  # type: ignore[method-assign]
        speeds = await asyncio.to_thread(measure_speeds, h.runtime, h.artifacts.config.vocab_size, 512)
        assert stalled == [1]
        assert speeds.step_measured and speeds.step_s < stall_s / 2 and speeds.best_step_s == speeds.step_s

    run(model_dir, body)


def test_follower_join_bench_smoke(model_dir: Path, tmp_path: Path) -> None:
    """``bench/follower_join.py`` runs end to end on a tiny model and writes its figures (not asserted)."""
    args = ["--model", str(model_dir), "--prefix", "128", "--long", "256", "--rounds", "1", "--max-token-id", "250"]
    code, figures = run_bench("follower_join.py", args, tmp_path / "figures.json")
    assert code == 0
    names = [f["name"] for f in figures]
    assert names[0] == "follower lag behind the leader's first token" and len(names) == 4
    assert all(f["value"] > 0 for f in figures[1:])
