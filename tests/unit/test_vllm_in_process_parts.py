"""The pure parts of an in-process vLLM engine: what its stat logger makes of vLLM's stats, the sampling it asks
for, the engine arguments it shares with the OpenAI server's command line, and ``--vllm-in-process``'s settings."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvrelay.cli.router import IN_PROCESS_POLL_S, in_process_engines
from kvrelay.engines.vllm.client import request_body
from kvrelay.engines.vllm.in_process import SAMPLING_FIELDS, EngineTally, request_params
from kvrelay.engines.vllm.metrics import EngineFigures
from kvrelay.launch.vllm_server import VllmServerSpec
from kvrelay.protocol.messages import Sampling


def _scheduler(running: int, waiting: int, usage: float, hits: int, queries: int) -> SimpleNamespace:
    prefix = SimpleNamespace(hits=hits, queries=queries)
    return SimpleNamespace(
        num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage, prefix_cache_stats=prefix
    )


def _finished(prompt: int, cached: int, prefill_s: float) -> SimpleNamespace:
    return SimpleNamespace(num_prompt_tokens=prompt, num_cached_tokens=cached, prefill_time=prefill_s)


def test_the_tally_keeps_the_last_scheduler_figures_and_sums_hits_and_computed_prefill() -> None:
    tally = EngineTally(EngineFigures(num_blocks=256, block_size=64))
    tally.record(_scheduler(2, 1, 0.25, 64, 128), SimpleNamespace(finished_requests=[_finished(300, 128, 0.02)]))
    tally.record(_scheduler(1, 0, 0.5, 0, 64), None)
    tally.record(None, SimpleNamespace(finished_requests=[_finished(100, -1, 0.01), _finished(64, 64, 0.001)]))
    figures = tally.figures
    assert (figures.running, figures.waiting, figures.kv_usage) == (1, 0, 0.5)
    assert (figures.prefix_hits, figures.prefix_queries) == (64, 192)
    assert (figures.num_blocks, figures.block_size, figures.used_blocks) == (256, 64, 128)
    totals = figures.totals
    assert totals.prefill_requests == 3
    assert totals.prefill_seconds == pytest.approx(0.031)
    assert totals.prefill_tokens == (300 - 128) + 100 + 0  # a negative cached count (vLLM's unknown) counts 0


def test_an_in_process_request_samples_as_the_http_request_does_without_vllms_detokenizer() -> None:
    sampling = Sampling(temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(2, 5))
    params = request_params(12, sampling, 99)
    body = request_body("m", (1, 2, 3), 12, sampling, 99)
    assert params == {**{k: body[k] for k in SAMPLING_FIELDS}, "detokenize": False}
    assert (params["temperature"], params["top_k"], params["seed"], params["stop_token_ids"]) == (0.7, -1, 99, [2, 5])
    assert params["ignore_eos"] is True and params["max_tokens"] == 12


def test_the_engine_arguments_are_the_servers_without_its_http_flags() -> None:
    spec = VllmServerSpec("/m", 8100, 5557, "/venv/bin/python", served_name="m", kv_cache_bytes=1 << 20, max_num_seqs=4)
    engine, server = spec.engine_argv(), spec.argv()
    assert server[3 : 3 + len(engine)] == engine
    for flag in ("--host", "--port", "--served-model-name", "--enable-prompt-tokens-details"):
        assert flag in server and flag not in engine
    assert engine[engine.index("--kv-cache-memory-bytes") + 1] == str(1 << 20)
    assert '"tcp://*:5557"' in engine[engine.index("--kv-events-config") + 1]


def test_in_process_engines_follow_the_servers_ids_on_their_own_event_ports(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    settings = in_process_engines(2, 1, [str(model)], "float32", 8, 1 << 22, 2048)
    assert [s.worker_id for s in settings] == ["v2", "v3"]
    specs = [s.in_process for s in settings]
    assert all(spec is not None and spec.model == str(model.resolve()) for spec in specs)
    assert len({s.kv_events for s in settings}) == 2
    assert all(s.poll_s == IN_PROCESS_POLL_S and s.engine_url.startswith("in-process://") for s in settings)
    assert in_process_engines(0, 0, [], "float32", 8, None, None) == ()
    with pytest.raises(ValueError, match="exactly one --model"):
        in_process_engines(1, 0, [str(model), str(model)], "float32", 8, None, None)
    with pytest.raises(ValueError, match="exactly one --model"):
        in_process_engines(1, 0, [str(tmp_path / "absent")], "float32", 8, None, None)
