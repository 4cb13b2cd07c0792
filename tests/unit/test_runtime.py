"""The device loop (docs/design.md section 8) over a tiny real model saved as real artifacts."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kvrelay.core.planning.predicted_ttft import pages_needed as pages_for
from kvrelay.models.batch import ForwardBatch
from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.registry import build_model
from kvrelay.protocol.messages import Sampling
from kvrelay.testing.tiny_models import make_tiny_model
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.runtime.iteration import PolicyConfig
from kvrelay.worker.runtime.jobs import Job, JobResult, QueueFullError, RuntimeClosedError, RuntimeEvent, TokenEvent
from kvrelay.worker.runtime.loop import PagedRuntime
from tests.support.bench_smoke import run_bench
from tests.support.processes import wait_until
from tests.support.step_models import DelegatingModel, RecordingModel

PAGE = 4
WAIT = 30.0  # generous timeout for every event wait; the tests normally take milliseconds


@dataclass
class Tiny:
    config: ModelConfig
    model: Any
    directory: Path
    references: dict[tuple[tuple[int, ...], int], list[int]]


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    directory = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=7)
    config = ModelConfig.from_hf(json.loads((Path(directory) / "config.json").read_text()))
    weights = load_file(str(Path(directory) / "model.safetensors"))
    return Tiny(config, build_model(config, weights, torch.float32, "cpu"), Path(directory), {})


def new_kv(tiny: Tiny, num_pages: int = 256) -> KVPages:
    return KVPages.allocate(tiny.config, num_pages, PAGE, torch.float32, "cpu")


def reference_greedy(tiny: Tiny, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens of one sequence run alone: one prefill forward, then one forward per token."""
    key = (tuple(prompt), max_new)
    if key not in tiny.references:
        tiny.references[key] = _run_alone(tiny, prompt, max_new)
    return tiny.references[key]


def _run_alone(tiny: Tiny, prompt: list[int], max_new: int) -> list[int]:
    kv = new_kv(tiny, pages_for(len(prompt) + max_new, PAGE))
    table = list(range(kv.num_pages))
    out: list[int] = []
    with torch.inference_mode():
        logits = tiny.model.forward(ForwardBatch.build([(prompt, 0, table)]), kv)
        while True:
            out.append(int(logits[-1].argmax()))
            if len(out) == max_new:
                return out
            pos = len(prompt) + len(out) - 1
            logits = tiny.model.forward(ForwardBatch.build([([out[-1]], pos, table)]), kv)


def prompt_of(length: int, salt: int) -> list[int]:
    return [4 + (salt * 31 + i * 7) % 300 for i in range(length)]


class GatedModel(DelegatingModel):
    """The real model, whose next forward waits for ``release`` after setting ``entered``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_next = False

    def hold(self) -> None:
        self.entered.clear()
        self.release.clear()

    def hidden(self, batch: ForwardBatch, kv: KVPages) -> torch.Tensor:
        self.entered.set()
        assert self.release.wait(WAIT), "test never released the gated forward"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected forward failure")
        return self.model.hidden(batch, kv)


@pytest.fixture
def gated(tiny: Tiny) -> Iterator[tuple[PagedRuntime, GatedModel, PagePool]]:
    model = GatedModel(tiny.model)
    runtime = PagedRuntime(model, new_kv(tiny), PolicyConfig(num_lanes=1, token_budget=64), queue_capacity=2)
    yield runtime, model, PagePool(256)
    model.release.set()
    runtime.close()


def job_for(pool: PagePool, prompt: list[int], max_new: int, **kw: Any) -> Job:
    pages = pool.allocate(pages_for(len(prompt) + max_new, PAGE))
    return Job(tuple(prompt), tuple(pages), max_new_tokens=max_new, **kw)


@pytest.mark.parametrize("lanes,budget", [(3, 8), (1, 16), (8, 64)])
def test_concurrent_greedy_generation_matches_step_by_step_reference(tiny: Tiny, lanes: int, budget: int) -> None:
    lengths, budgets = [3, 21, 40, 9, 33, 1], [12, 5, 9, 15, 1, 6]
    prompts = [prompt_of(n, i) for i, n in enumerate(lengths)]
    pool = PagePool(256)
    events: dict[int, list[TokenEvent]] = {}
    model = RecordingModel(tiny.model)
    with PagedRuntime(model, new_kv(tiny), PolicyConfig(lanes, budget), queue_capacity=8) as runtime:
        handles = []
        for prompt, max_new in zip(prompts, budgets):
            handle = runtime.submit(job_for(pool, prompt, max_new), on_event=_collect(events))
            handles.append(handle)
        results = [h.result(WAIT) for h in handles]
    for handle, prompt, max_new, result in zip(handles, prompts, budgets, results):
        expected = reference_greedy(tiny, prompt, max_new)
        assert list(result.tokens) == expected, f"prompt of {len(prompt)} tokens"
        assert result.finish_reason == "length"
        assert result.kv_end == len(prompt) + max_new - 1
        seen = events[handle.job_id]
        assert [e.token for e in seen[:-1]] == expected and isinstance(seen[-1], JobResult)
        assert [e.index for e in seen[:-1]] == list(range(max_new))
        assert [e.position for e in seen[:-1]] == list(range(len(prompt), len(prompt) + max_new))
    assert all(sum(q) <= budget for q in model.batches), "a forward exceeded the token budget"
    if lanes > 1:
        mixed = [q for q in model.batches if 1 in q and any(n > 1 for n in q)]
        assert mixed, "decode rows and prefill chunks must share one forward"


def _collect(store: dict[int, list[Any]]) -> Any:
    def on_event(event: RuntimeEvent) -> None:
        store.setdefault(event.job_id, []).append(event)

    return on_event


def test_continuation_over_resident_prefix_and_stop_ids(tiny: Tiny) -> None:
    prompt = prompt_of(37, 3)
    expected = reference_greedy(tiny, prompt, 8)
    pool = PagePool(64)
    pages = tuple(pool.allocate(pages_for(len(prompt) + 8, PAGE)))
    with PagedRuntime(tiny.model, new_kv(tiny, 64), PolicyConfig(4, 10)) as runtime:
        prefix = runtime.generate(Job(tuple(prompt[:30]), pages), WAIT)
        assert prefix.finish_reason == "length" and prefix.tokens == () and prefix.kv_end == 30
        rest = runtime.generate(Job(tuple(prompt[30:]), pages, start_pos=30, max_new_tokens=8), WAIT)
        assert list(rest.tokens) == expected
        stop_at = expected[3]
        sampling = Sampling(stop_token_ids=(stop_at,))
        stopped = runtime.generate(Job(tuple(prompt), pages, max_new_tokens=8, sampling=sampling), WAIT)
    assert stopped.finish_reason == "stop"
    assert list(stopped.tokens) == expected[: expected.index(stop_at) + 1]


def test_the_device_thread_carries_its_name_in_the_os(tiny: Tiny) -> None:
    """``top -H``, ``perf`` and ``/proc`` tell the device thread (and the team it starts) from the process's others."""

    def os_names() -> list[str]:
        names = []
        for task in Path("/proc/self/task").iterdir():
            try:
                names.append((task / "comm").read_text().strip())
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        return names

    pool = PagePool(64)
    prompt = prompt_of(9, 2)
    with PagedRuntime(tiny.model, new_kv(tiny, 64), PolicyConfig(2, 16), name="kvrelay-dev-t1") as runtime:
        runtime.generate(
            Job(tuple(prompt), tuple(pool.allocate(pages_for(len(prompt) + 2, PAGE))), max_new_tokens=2), WAIT
        )
        # the device thread, and the team it started for its parallel ops (which takes its name), if any
        assert "kvrelay-dev-t1" in os_names()
    wait_until(lambda: "kvrelay-dev-t1" not in os_names() or None, WAIT, "the device thread and its team to end")


def test_cancel_marks_at_once_but_quiesces_after_the_step_in_flight(gated: Any) -> None:
    runtime, model, pool = gated
    events: dict[int, list[Any]] = {}
    model.hold()
    handle = runtime.submit(job_for(pool, prompt_of(10, 1), 20), on_event=_collect(events))
    assert model.entered.wait(WAIT)  # the prefill forward is in flight, blocked in the model
    handle.cancel()
    assert handle.cancel_requested
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.2)  # not quiesced while its step is still running
    model.release.set()
    result = handle.result(WAIT)
    assert result.finish_reason == "cancelled"
    assert result.kv_end == 10, "the step in flight finished and wrote its K/V"
    assert result.tokens == () and [type(e) for e in events[handle.job_id]] == [JobResult]


def test_cancel_of_a_waiting_job_and_cancel_twice(gated: Any) -> None:
    runtime, model, pool = gated
    model.hold()
    running = runtime.submit(job_for(pool, prompt_of(5, 2), 3))
    assert model.entered.wait(WAIT)
    queued = runtime.submit(job_for(pool, prompt_of(5, 3), 3))
    queued.cancel()
    queued.cancel()
    model.release.set()
    assert running.result(WAIT).finish_reason == "length"
    result = queued.result(WAIT)
    assert result.finish_reason == "cancelled" and result.admitted_s is None and result.kv_end == 0


def test_bounded_queue_blocks_then_raises_queue_full(gated: Any) -> None:
    runtime, model, pool = gated
    model.hold()
    first = runtime.submit(job_for(pool, prompt_of(4, 0), 2))
    assert model.entered.wait(WAIT)  # admitted to the only lane; the queue is empty again
    queued = [runtime.submit(job_for(pool, prompt_of(4, i), 2), timeout=0) for i in (1, 2)]
    with pytest.raises(QueueFullError, match="queue is full"):
        runtime.submit(job_for(pool, prompt_of(4, 3), 2), timeout=0)
    with pytest.raises(QueueFullError):
        runtime.submit(job_for(pool, prompt_of(4, 4), 2), timeout=0.05)
    blocked_job = job_for(pool, prompt_of(4, 5), 2)
    submitted = threading.Event()
    threading.Thread(target=lambda: (runtime.submit(blocked_job), submitted.set()), daemon=True).start()
    assert not submitted.wait(0.2), "submit must block while the queue is full"
    model.release.set()
    assert submitted.wait(WAIT), "submit must return once the device loop admits a job"
    assert all(h.result(WAIT).finish_reason == "length" for h in [first, *queued])


def test_asyncio_bridge_streams_tokens_and_cancels(tiny: Tiny) -> None:
    prompt = prompt_of(19, 5)
    expected = reference_greedy(tiny, prompt, 7)
    pool = PagePool(128)

    async def scenario(runtime: PagedRuntime) -> None:
        stream = await runtime.submit_async(job_for(pool, prompt, 7))
        tokens = [event.token async for event in stream]
        assert tokens == expected
        assert (await stream.result()).tokens == tuple(expected)
        long = await runtime.submit_async(job_for(pool, prompt, 40))
        async for event in long:
            if event.index == 2:
                long.cancel()
        result = await asyncio.wait_for(long.result(), WAIT)
        assert result.finish_reason == "cancelled" and 3 <= len(result.tokens) < 40

    with PagedRuntime(tiny.model, new_kv(tiny, 128), PolicyConfig(2, 16)) as runtime:
        asyncio.run(asyncio.wait_for(scenario(runtime), WAIT))


def test_async_submit_waits_for_queue_space_without_blocking_the_loop(gated: Any) -> None:
    runtime, model, pool = gated
    model.hold()
    runtime.submit(job_for(pool, prompt_of(4, 0), 2))
    assert model.entered.wait(WAIT)
    for i in (1, 2):
        runtime.submit(job_for(pool, prompt_of(4, i), 2))

    async def scenario() -> None:
        with pytest.raises(QueueFullError):
            await runtime.submit_async(job_for(pool, prompt_of(4, 3), 2), timeout=0)
        waiting = asyncio.ensure_future(runtime.submit_async(job_for(pool, prompt_of(4, 4), 2)))
        done, _ = await asyncio.wait({waiting}, timeout=0.2)  # the loop keeps running meanwhile
        assert not done, "submit_async must wait while the queue is full"
        model.release.set()
        stream = await asyncio.wait_for(waiting, WAIT)
        assert (await asyncio.wait_for(stream.result(), WAIT)).finish_reason == "length"

    asyncio.run(scenario())


def test_forward_failure_fails_its_batch_and_the_loop_keeps_serving(gated: Any) -> None:
    runtime, model, pool = gated
    model.fail_next = True
    failed = runtime.submit(job_for(pool, prompt_of(6, 1), 3)).result(WAIT)
    assert failed.finish_reason == "error" and "injected forward failure" in (failed.error or "")
    assert runtime.submit(job_for(pool, prompt_of(6, 1), 3)).result(WAIT).finish_reason == "length"


def test_rejects_a_page_table_too_short_with_a_clear_error(tiny: Tiny) -> None:
    with PagedRuntime(tiny.model, new_kv(tiny, 8), PolicyConfig(2, 8)) as runtime:
        with pytest.raises(ValueError, match="give it 3 pages"):
            runtime.submit(Job(tuple(range(4, 12)), (0,), max_new_tokens=3))
        with pytest.raises(ValueError, match="outside the pool of 8 pages"):
            runtime.submit(Job((5,), (8,)))


def test_close_cancels_queued_and_running_jobs(gated: Any) -> None:
    runtime, model, pool = gated
    model.hold()
    running = runtime.submit(job_for(pool, prompt_of(4, 0), 50))
    assert model.entered.wait(WAIT)
    queued = runtime.submit(job_for(pool, prompt_of(4, 1), 2))
    closer = threading.Thread(target=runtime.close)
    closer.start()
    model.release.set()
    closer.join(WAIT)
    assert queued.result(WAIT).finish_reason == "cancelled"
    assert running.result(WAIT).finish_reason == "cancelled"


def test_runtime_bench_smoke(tmp_path: Path) -> None:
    """bench/runtime.py runs end to end on a tiny model and writes every figure (values not asserted)."""
    model_dir = make_tiny_model("gemma3", tmp_path / "tiny", seed=1)
    argv = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--sequences",
        "3",
        "--min-prompt",
        "8",
        "--max-prompt",
        "24",
        "--new-tokens",
        "4",
        "--hf-batch",
        "2",
        "--prefill-tokens",
        "32",
        "--ttft-tokens",
        "48",
        "--resident-tokens",
        "40",
        "--single-prompt",
        "12",
        "--single-new-tokens",
        "3",
    ]
    code, figures = run_bench("runtime.py", argv, tmp_path / "figures.json")
    assert code == 0
    assert {f["name"] for f in figures} >= {
        "decode_tokens_per_s",
        "decode_batch1_tokens_per_s",
        "prefill_tokens_per_s",
        "warm_ttft_share",
        "peak_rss_kvrelay",
    }
    assert all(set(f) == {"name", "value", "unit", "baseline", "baseline_value"} for f in figures)


def test_generate_cli_prints_the_greedy_continuation(tiny: Tiny, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    from kvrelay.cli.main import main

    tokenizer = AutoTokenizer.from_pretrained(tiny.directory)
    prompt = "The capital of France is"
    expected = reference_greedy(tiny, list(tokenizer(prompt)["input_ids"]), 6)
    if tiny.config.eos_token_ids and set(expected) & set(tiny.config.eos_token_ids):
        expected = expected[: min(expected.index(e) for e in tiny.config.eos_token_ids if e in expected) + 1]
    assert main(["generate", "--model", str(tiny.directory), "--max-tokens", "6", "--threads", "1", prompt]) == 0
    printed = capsys.readouterr().out
    assert printed == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert main(["generate", "--model", str(tiny.directory / "missing"), "--max-tokens", "2", prompt]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cancel_from_the_event_callback_stops_after_that_token(tiny: Tiny) -> None:
    """A cancel issued on the device thread (inside ``on_event``) takes effect before the next step."""
    pool = PagePool(64)
    handles: list[Any] = []
    recorded = threading.Event()

    def on_event(event: RuntimeEvent) -> None:
        if isinstance(event, TokenEvent) and event.index == 2:
            assert recorded.wait(WAIT)
            handles[0].cancel()

    with PagedRuntime(tiny.model, new_kv(tiny, 64), PolicyConfig(2, 16)) as runtime:
        job = job_for(pool, prompt_of(9, 4), 30)
        handles.append(runtime.submit(job, on_event))
        recorded.set()
        result = handles[0].result(WAIT)
    assert result.finish_reason == "cancelled"
    assert list(result.tokens) == reference_greedy(tiny, prompt_of(9, 4), 3)
    assert result.kv_end == 9 + 2


def test_engine_generates_and_returns_its_pages(tiny: Tiny) -> None:
    from kvrelay.worker.runtime.engine import Engine, EngineOptions

    prompt = prompt_of(12, 6)
    with Engine.open(tiny.directory, "float32", EngineOptions(kv_tokens=256, page_tokens=PAGE, num_lanes=2)) as engine:
        total = engine.pool.num_pages
        result = engine.generate(prompt, 5, Sampling())
        assert list(result.tokens) == reference_greedy(tiny, prompt, 5)
        assert engine.pool.num_free == total
        with pytest.raises(TimeoutError):
            engine.generate(prompt, 60, Sampling(), timeout=0)
        assert engine.pool.num_free == total, "a timed-out job's pages come back once it has quiesced"


def test_the_device_thread_alone_runs_torch_in_parallel_and_runs_calls_between_steps(tiny: Tiny) -> None:
    with PagedRuntime(tiny.model, new_kv(tiny, 8), PolicyConfig(2, 8), threads=2) as runtime:
        assert runtime.run_on_device(torch.get_num_threads, timeout=WAIT) == 2
        assert torch.get_num_threads() == 1  # the constructing thread runs torch serially
        seen: list[int] = []
        other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        other.start()
        other.join(WAIT)
        assert seen == [1]
        assert runtime.run_on_device(lambda: torch.is_inference_mode_enabled(), timeout=WAIT) is False
        with pytest.raises(ZeroDivisionError):
            runtime.run_on_device(lambda: 1 // 0, timeout=WAIT)
        done = runtime.submit(Job(tuple(range(4, 8)), (0, 1), max_new_tokens=2)).result(WAIT)
        assert done.finish_reason == "length"  # the loop keeps serving after a failed call
    with pytest.raises(RuntimeClosedError):
        runtime.run_on_device(torch.get_num_threads)


def test_waiting_jobs_are_admitted_by_priority_and_a_running_one_is_not_passed(tiny: Tiny) -> None:
    gated = GatedModel(tiny.model)
    pool = PagePool(256)
    with PagedRuntime(gated, new_kv(tiny), PolicyConfig(num_lanes=1, token_budget=64), queue_capacity=8) as runtime:
        gated.hold()
        running = runtime.submit(job_for(pool, prompt_of(6, 0), 2, priority=9.0))
        assert gated.entered.wait(WAIT)  # admitted to the only lane, its prefill blocked in the model
        finished: list[str] = []  # one lane: jobs finish in the order they were admitted
        handles = [
            runtime.submit(
                job_for(pool, prompt_of(6, i + 1), 2, priority=p),
                on_event=lambda e, name=name: finished.append(name) if isinstance(e, JobResult) else None,
            )
            for i, (name, p) in enumerate(
                [("late5", 5.0), ("first1", 1.0), ("later5", 5.0), ("second1", 1.0), ("default0", 0.0)]
            )
        ]
        gated.release.set()
        assert running.result(WAIT).finish_reason == "length"
        assert all(h.result(WAIT).finish_reason == "length" for h in handles)
    assert finished == ["default0", "first1", "second1", "late5", "later5"]


def test_a_job_expecting_followers_that_never_come_still_finishes(tiny: Tiny) -> None:
    """The hold after a first token is bounded: with no ``followers_submitted`` the job and the jobs queued
    behind it still finish, each after its own forwards."""
    gated = GatedModel(tiny.model)
    pool = PagePool(256)
    with PagedRuntime(gated, new_kv(tiny), PolicyConfig(num_lanes=2, token_budget=64), queue_capacity=8) as runtime:
        gated.hold()
        leader = runtime.submit(job_for(pool, prompt_of(6, 0), 3))
        assert gated.entered.wait(WAIT)  # its prefill is in the model: its first token is still to come
        leader.expect_followers()
        behind = runtime.submit(job_for(pool, prompt_of(9, 1), 2))
        gated.release.set()
        assert leader.result(WAIT).tokens == tuple(reference_greedy(tiny, prompt_of(6, 0), 3))
        assert behind.result(WAIT).tokens == tuple(reference_greedy(tiny, prompt_of(9, 1), 2))


def test_waiting_jobs_of_equal_priority_are_admitted_by_place_then_submission(tiny: Tiny) -> None:
    """A job resubmitted after waiting for a shared prefix (an earlier ``place``) is not passed by jobs of the
    same priority submitted while it waited."""
    gated = GatedModel(tiny.model)
    pool = PagePool(256)
    with PagedRuntime(gated, new_kv(tiny), PolicyConfig(num_lanes=1, token_budget=64), queue_capacity=8) as runtime:
        gated.hold()
        running = runtime.submit(job_for(pool, prompt_of(6, 0), 2))
        assert gated.entered.wait(WAIT)
        finished: list[str] = []
        handles = [
            runtime.submit(
                job_for(pool, prompt_of(6, i + 1), 2, place=place),
                on_event=lambda e, name=name: finished.append(name) if isinstance(e, JobResult) else None,
            )
            for i, (name, place) in enumerate([("later", 5.0), ("resubmitted", 3.0), ("same", 5.0)])
        ]
        gated.release.set()
        assert running.result(WAIT).finish_reason == "length"
        assert all(h.result(WAIT).finish_reason == "length" for h in handles)
    assert finished == ["resubmitted", "later", "same"]
