"""The device loop admits waiting jobs by ``Job.priority`` (lower first, ties in submission order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.models.config import ModelConfig
from kvrelay.models.kv_pages import KVPages
from kvrelay.models.registry import build_model
from kvrelay.worker.iteration import PolicyConfig
from kvrelay.worker.jobs import JobResult
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.runtime import PagedRuntime
from tests.support.tiny_models import make_tiny_model
from tests.unit.test_runtime import PAGE, WAIT, GatedModel, job_for, prompt_of


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, object]:
    directory = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"), seed=7)
    config = ModelConfig.from_hf(json.loads((Path(directory) / "config.json").read_text()))
    weights = load_file(str(Path(directory) / "model.safetensors"))
    return config, build_model(config, weights, torch.float32, "cpu")


def test_waiting_jobs_are_admitted_by_priority_and_a_running_one_is_not_passed(
    tiny_model: tuple[ModelConfig, object],
) -> None:
    config, model = tiny_model
    gated = GatedModel(model)
    kv = KVPages.allocate(config, 256, PAGE, torch.float32, "cpu")
    pool = PagePool(256)
    with PagedRuntime(gated, kv, PolicyConfig(num_lanes=1, token_budget=64), queue_capacity=8) as runtime:
        gated.hold()
        running = runtime.submit(job_for(pool, prompt_of(6, 0), 2, priority=9.0))
        assert gated.entered.wait(WAIT)  # admitted to the only lane, its prefill blocked in the model
        finished: list[str] = []  # one lane: jobs finish in the order they were admitted
        handles = [
            runtime.submit(job_for(pool, prompt_of(6, i + 1), 2, priority=p),
                           on_event=lambda e, name=name: finished.append(name) if isinstance(e, JobResult) else None)
            for i, (name, p) in enumerate([("late5", 5.0), ("first1", 1.0), ("later5", 5.0), ("second1", 1.0),
                                           ("default0", 0.0)])
        ]
        gated.release.set()
        assert running.result(WAIT).finish_reason == "length"
        assert all(h.result(WAIT).finish_reason == "length" for h in handles)
    assert finished == ["default0", "first1", "second1", "late5", "later5"]
