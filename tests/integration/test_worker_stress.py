"""200 offers with shared prefixes, random budgets and random cancellations against one small worker."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from kvrelay.protocol.chunk_keys import prompt_chain
from kvrelay.protocol.messages import OfferResult, Result, RouteSegment
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.worker_harness import WorkerHarness

SEED = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def test_two_hundred_offers_each_end_exactly_once_and_leak_nothing(model_dir: Path) -> None:
    print(f"seed={SEED}")
    rng = random.Random(SEED)
    documents = [tuple(rng.randrange(4, 250) for _ in range(256)) for _ in range(6)]

    async def main() -> None:
        h = WorkerHarness(model_dir, num_pages=80, lanes=4)
        try:
            outcomes: dict[str, str] = {}
            prompt_tokens = cached_tokens = 0

            async def one(i: int) -> None:
                nonlocal prompt_tokens, cached_tokens
                await asyncio.sleep(0)  # interleave offers with the others' progress
                doc = rng.choice(documents)
                prompt = doc[: rng.randrange(16, 256)] + tuple(
                    rng.randrange(4, 250) for _ in range(rng.randrange(1, 40))
                )
                resident = len(h.pool.resident_prefix(prompt_chain(h.fingerprint, prompt, 64)))
                route = (RouteSegment("gpu", resident),) if resident else ()
                offer, replies = h.offer(f"r{i}", prompt, rng.randrange(1, 20), route=route)
                cancel_after = rng.choice([None, None, 0, 1, 3])
                answer = await replies.wait_for(OfferResult, timeout=60)
                if not answer.accepted:
                    outcomes[offer.assignment.request_id] = "declined"
                    return
                if cancel_after is not None:
                    await replies.wait_tokens(cancel_after, timeout=60)
                    h.cancel(offer)
                    outcomes[offer.assignment.request_id] = "cancelled"
                    return
                result = await replies.wait_for(Result, timeout=120)
                assert len(replies.of(Result)) == 1
                outcomes[offer.assignment.request_id] = "result"
                prompt_tokens += result.usage.prompt_tokens
                cached_tokens += sum(result.usage.cached_tokens.values())

            batch: list[asyncio.Task[None]] = []
            for i in range(200):
                batch.append(asyncio.create_task(one(i)))
                if len(batch) == 8:
                    await asyncio.gather(*batch)
                    batch = []
            await asyncio.gather(*batch)
            await h.quiesce(timeout=60)
            assert len(outcomes) == 200
            h.pool.check()
            assert h.pool.num_reserved == 0 and h.pool.num_referenced == 0
            counts = {k: list(outcomes.values()).count(k) for k in ("result", "declined", "cancelled")}
            hit_share = cached_tokens / max(prompt_tokens, 1)
            print(f"outcomes={counts} prefix hit share={hit_share:.2%}")
            assert counts["result"] > 50 and hit_share > 0.2
        finally:
            h.close()

    asyncio.run(main())
