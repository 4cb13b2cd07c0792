"""413 for a request larger than any worker, 429 with Retry-After when the router queue is full, 503 when no worker
serves the model: real router, real app."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvrelay.api.app import create_app
from kvrelay.api.ingress import Ingress
from kvrelay.api.metrics import Metrics
from kvrelay.api.served_model import ServedModel
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.core.router.queue import Limits
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.router.cluster_router import ClusterRouter
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.router_driver import heartbeat


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_artifacts(make_tiny_model("llama", tmp_path_factory.mktemp("codes"))).tokenizer


def post(router: ClusterRouter, tokenizer, body: dict, *more: dict) -> httpx.Response:  # type: ignore[no-untyped-def]
    """POST ``body`` (after ``more``, each left waiting) to /v1/completions; the response to ``body``."""
    served = ServedModel("m", tokenizer, "llama", 4096)

    def serving(name: str) -> bool:
        return any(name in v.heartbeat.models for v in router.state.views.values())

    app = create_app(Ingress(router, {"m": served}, Metrics(), serving))

    async def call() -> httpx.Response:
        router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvrelay") as c:
                waiting = [asyncio.create_task(c.post("/v1/completions", json=b, timeout=30)) for b in more]
                while router.state.queued() < len(more):
                    await asyncio.sleep(0.01)
                response = await c.post("/v1/completions", json=body, timeout=30)
                for task in waiting:
                    task.cancel()
                return response
        finally:
            await router.close()

    return asyncio.run(call())


def test_no_worker_serving_the_model_is_a_503(tokenizer) -> None:  # type: ignore[no-untyped-def]
    router = ClusterRouter(new_router(), lambda w, m: None)
    r = post(router, tokenizer, {"model": "m", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 503 and "no worker serves model 'm'" in r.json()["error"]["message"]


def test_a_request_larger_than_any_worker_is_a_413_saying_what_fits(tokenizer) -> None:  # type: ignore[no-untyped-def]
    offers: list[object] = []
    router = ClusterRouter(new_router(RouterConfig(worker_expiry_s=120.0)), lambda w, m: offers.append(m), tick_s=0.05)
    # One live worker whose whole pool (2 pages of 16 tokens) is smaller than the request needs.
    router.receive(heartbeat("w0", models=("m",), pages_total=2, pages_free=2, context_limit=4096))
    r = post(router, tokenizer, {"model": "m", "prompt": "hello " * 40, "max_tokens": 32})
    error = r.json()["error"]
    assert r.status_code == 413 and error["code"] == "kv_capacity_exceeded" and "holds 32 when idle" in error["message"]
    assert offers == [], "no worker was offered a request it cannot hold"


def test_a_full_router_queue_is_a_429_with_retry_after(tokenizer) -> None:  # type: ignore[no-untyped-def]
    config = RouterConfig(worker_expiry_s=120.0, queue=Limits(max_requests=1))
    router = ClusterRouter(new_router(config), lambda w, m: None, tick_s=0.05)
    # A worker whose device queue is longer than the start bound: requests wait at the router.
    router.receive(heartbeat("w0", models=("m",), queue_delay_s=60.0, context_limit=4096))
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    r = post(router, tokenizer, body, body)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    assert "1 requests are waiting" in error["message"]


def test_a_model_whose_workers_have_not_registered_yet_is_a_503_with_retry_after(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """After a router (re)start the router has loaded the model but no worker has announced it: the client is told
    to retry, not that the model does not exist; a model the router never loaded is still a 404."""
    router = ClusterRouter(new_router(), lambda w, m: None)
    app = create_app(Ingress(router, {}, Metrics(), lambda name: False, awaited={"m"}))

    async def call() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvrelay") as c:
            body = {"prompt": "hello", "max_tokens": 4}
            return (
                await c.post("/v1/completions", json={"model": "m", **body}),
                await c.post("/v1/completions", json={"model": "other", **body}),
            )

    awaited, unknown = asyncio.run(call())
    assert awaited.status_code == 503 and awaited.headers["Retry-After"] == "2"
    assert "no worker registered yet" in awaited.json()["error"]["message"]
    assert unknown.status_code == 404 and "is not served" in unknown.json()["error"]["message"]
