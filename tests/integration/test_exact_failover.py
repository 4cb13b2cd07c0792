"""Failover the client cannot see: after ``kill -9`` of a worker mid-stream, every stream's text equals the
same stream undisturbed, greedy and seeded (seeded where the machine's projections are batch-invariant:
``decode_rows_batch_invariant``).

A router and two workers (real processes) serve a tiny random Gemma 3 in bfloat16 without an EOS id (every
stream runs to its budget; sliding window 16, so decode rows wrap their window rings). Six streams of 96
tokens run undisturbed, then again while the worker holding the most of them mid-way is killed; the router
continues those elsewhere, and the continuation replays the delivered tokens as decode steps
(``Job.replay``), so it computes what the killed worker would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvrelay.bench.failover import Cut, StreamSpec, compare, run_round
from kvrelay.launch.child import ChildProcess
from kvrelay.models.kernels.native.mlp_rows import DecodeMLP
from kvrelay.models.mlp import ACTIVATIONS, PackedLinear
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import Router, start_worker, stop_all, wait_until

pytestmark = pytest.mark.timeout(300)

BUDGET = 96
PROMPTS = [tuple(5 + (salt * 37 + i * 11) % 370 for i in range(12 + 5 * salt)) for salt in range(6)]
WORKER_FLAGS = ("--dtype", "bfloat16", "--lanes", "8", "--chunk-tokens", "256")
"""256-token chunks: no chunk of a stream is ever registered, so a continuation cannot reuse K/V of the undisturbed
run and computes every delivered token's K/V itself."""


@dataclass
class Cluster:
    home: Path
    model: Path
    router: Router
    workers: dict[str, ChildProcess] = field(default_factory=dict)

    def start(self, *worker_ids: str) -> None:
        for wid in worker_ids:
            self.workers[wid] = start_worker(self.home, wid, self.router.workers_url, self.model, *WORKER_FLAGS)
        wait_until(lambda: set(worker_ids) <= set(self.router.live_workers()), 90, f"workers {worker_ids} live")

    def kill(self, worker_id: str) -> None:
        self.workers.pop(worker_id).process.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("exact-failover")
    model = make_tiny_model("gemma3", home / "gemma", seed=3, hidden_size=256, intermediate_size=768, eos_token_id=None)
    router = Router(home, model, "--offer-timeout-s", "2.0", "--worker-expiry-s", "4.0")
    c = Cluster(home, model, router)
    try:
        c.start("w1", "w2")
        yield c
    finally:
        stop_all([*c.workers.values(), c.router.child])


def decode_rows_batch_invariant() -> bool:
    """Whether a decode row of this model's shapes in bfloat16 gets the same bits whatever its batch: each
    projection alone (the runtime's one-row GEMV) as within a batch (oneDNN), and the MLP through the decode
    kernel (``DecodeMLP``, a step's few rows) as through oneDNN (a step with more rows: a continuation's
    replayed row can ride in a step with a prefill chunk). A seeded stream's text can only be exact across a
    failover where it does: the continuation runs its steps in other batches than the first attempt did, and at
    temperature 0.9 a last-bit difference in a logit moves a draw that falls near a boundary. On an Intel Xeon
    with AMX (2026-12-02) the projections differ; on the 2-core AMD EPYC with AVX-512 BF16 (2026-12-06) the
    projections agree and the MLPs do not (the seeded case failed in one run of four there, before and after that
    day's kernels). Greedy streams stay exact (an argmax does not move with a last bit); docs/design.md
    section 8 says where decode rows are batch-invariant."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((768, 256), (256, 768)):
        layer = PackedLinear(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        x = torch.randn(8, k, generator=gen).to(torch.bfloat16)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])
        if not torch.equal(alone, layer(x)):
            return False
    gate, up = (torch.randn(768, 256, generator=gen).div(16).to(torch.bfloat16) for _ in range(2))
    down = torch.randn(256, 768, generator=gen).div(28).to(torch.bfloat16)
    kernel = DecodeMLP.build(gate, up, down, ACTIVATIONS["gelu_pytorch_tanh"].native)
    if kernel is None:
        return True
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    g, u, d = PackedLinear(gate), PackedLinear(up), PackedLinear(down)
    return torch.equal(kernel(x), d(u.times(x, g.activated(x, ACTIVATIONS["gelu_pytorch_tanh"]))))


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_kill_9_mid_stream_continues_token_identical(cluster: Cluster, temperature: float) -> None:
    specs = [
        StreamSpec(p, BUDGET, temperature, seed=None if temperature == 0 else 70 + i) for i, p in enumerate(PROMPTS)
    ]
    url, name = cluster.router.http_url, cluster.model.name
    undisturbed, _ = run_round(url, name, specs)
    assert all(s.completion_tokens == BUDGET and s.error is None for s in undisturbed)
    assert len({s.text for s in undisturbed}) == len(specs), "distinct prompts should continue differently"
    lost = cluster.router.cluster()["router_counters"].get("worker_lost_assignments", 0)

    cut = Cut(lambda: cluster.router.cluster()["requests"], cluster.kill, min_delivered=8, min_left=24)
    disturbed, strike = run_round(url, name, specs, cut)
    assert strike is not None
    outcome = compare(undisturbed, disturbed, strike)
    assert outcome.complete == (True,) * len(specs), [s.error for s in disturbed]
    if temperature == 0 or decode_rows_batch_invariant():
        assert outcome.same == (True,) * len(specs)
    else:  # exactness of a seeded text needs batch-invariant decode rows (see decode_rows_batch_invariant)
        print(f"seeded streams identical after the failover: {outcome.same} (decode rows vary with the batch here)")
    assert strike.held >= 2
    counters = cluster.router.cluster()["router_counters"]
    assert counters["worker_lost_assignments"] >= lost + strike.held
    cluster.start(strike.victim)  # the next case starts with two workers again
