"""The worker-local controller on a tiny real Gemma 3: streaming, prefix reuse, exact cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvrelay.protocol.messages import OfferResult, Result, RouteSegment
from tests.support.tiny_models import make_tiny_model
from tests.support.worker_harness import WorkerHarness

PROMPT = tuple(range(5, 5 + 150))  # 2 full chunks + 22 tokens


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
