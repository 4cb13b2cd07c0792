"""429 when every worker declines for capacity, 503 when no worker serves the model: real router, real app."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvrelay.api.app import create_app
from kvrelay.api.ingress import Ingress, ServedModel
from kvrelay.api.metrics import Metrics
from kvrelay.core.router.machine import RouterConfig, new_router
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.router.cluster_router import ClusterRouter
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.router_driver import heartbeat


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_artifacts(make_tiny_model("llama", tmp_path_factory.mktemp("codes"))).tokenizer


def post(router: ClusterRouter, tokenizer, body: dict) -> httpx.Response:  # type: ignore[no-untyped-def]
    served = ServedModel("m", tokenizer, "llama", 4096)

    def serving(name: str) -> bool:
        return any(name in v.heartbeat.models for v in router.state.views.values())

    app = create_app(Ingress(router, {"m": served}, Metrics(), serving))

    async def call() -> httpx.Response:
        router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvrelay") as c:
                return await c.post("/v1/completions", json=body, timeout=30)
        finally:
            await router.close()

    return asyncio.run(call())


def test_no_worker_serving_the_model_is_a_503(tokenizer) -> None:  # type: ignore[no-untyped-def]
    router = ClusterRouter(new_router(), lambda w, m: None)
    r = post(router, tokenizer, {"model": "m", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 503 and "no worker serves model 'm'" in r.json()["error"]["message"]


def test_every_worker_without_capacity_is_a_429(tokenizer) -> None:  # type: ignore[no-untyped-def]
    offers: list[object] = []
    # The worker sends one heartbeat only, so it must not expire while a busy machine prepares the request.
    config = RouterConfig(max_queue_wait_s=0.3, worker_expiry_s=120.0)
    router = ClusterRouter(new_router(config), lambda w, m: offers.append(m), tick_s=0.05)
    # One live worker whose whole pool (2 pages of 16 tokens) is smaller than the request needs.
    router.receive(heartbeat("w0", models=("m",), pages_total=2, pages_free=2, context_limit=4096))
    r = post(router, tokenizer, {"model": "m", "prompt": "hello " * 40, "max_tokens": 32})
    assert r.status_code == 429 and r.json()["error"]["code"] == "no_capacity"
    assert offers == [], "no worker was offered a request it cannot hold"
