"""The pure parts of ``bench/real_routers.py``: cached prompt tokens read from engines' ``/metrics`` texts, and
the peer routers' command lines, a real model's engine context."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvrelay.bench.trace.engine_metrics import cached_prompt_tokens
from kvrelay.bench.trace.peers import Peer, peer_argv
from kvrelay.bench.trace.prompts import Scaling, slice_prompts
from kvrelay.bench.trace.vllm_engines import RealModel, real_model

DATA = Path(__file__).parents[1] / "data"
TRACE = Path(__file__).parents[2] / "data" / "traces" / "mooncake_synthetic_trace.jsonl"

KVRELAY_METRICS = """# HELP kvrelay_cached_tokens_total prompt tokens served from cache
# TYPE kvrelay_cached_tokens_total counter
kvrelay_cached_tokens_total{tier="device"} 640.0
kvrelay_cached_tokens_total{tier="host"} 64.0
kvrelay_cached_tokens_created{tier="device"} 1.7e+09
# HELP kvrelay_recomputed_tokens_total prompt tokens computed
# TYPE kvrelay_recomputed_tokens_total counter
kvrelay_recomputed_tokens_total 999.0
"""


def test_vllm_prefix_cache_hits_are_the_cached_tokens_not_the_queries() -> None:
    assert cached_prompt_tokens((DATA / "vllm_metrics.txt").read_text()) == 512.0


def test_kvrelay_cached_tokens_sum_every_tier_and_nothing_else() -> None:
    assert cached_prompt_tokens(KVRELAY_METRICS) == 704.0


def test_each_peer_listens_and_exports_metrics_on_loopback_with_the_given_policy() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for peer in Peer:
        argv = peer_argv(peer, "/x/" + peer.value, "cache_aware", 9000, 9001, urls)
        flags = dict(zip(argv, argv[1:], strict=False))
        assert (flags["--host"], flags["--port"], flags["--policy"]) == ("127.0.0.1", "9000", "cache_aware")
        assert (flags["--prometheus-host"], flags["--prometheus-port"]) == ("127.0.0.1", "9001")
        at = argv.index("--worker-urls")
        assert argv[at + 1 : at + 3] == urls
    assert peer_argv(Peer.SMG, "smg", "cache_aware", 1, 2, urls)[1] == "launch"
    assert peer_argv(Peer.VLLM_ROUTER, "vllm-router", "cache_aware", 1, 2, urls)[1] == "--host"


def test_a_real_models_engines_serve_at_most_its_own_context(tmp_path: Path) -> None:
    flat, nested, bare = (tmp_path / name for name in ("flat", "nested", "bare"))
    for directory, config in (
        (flat, {"max_position_embeddings": 32768}),
        (nested, {"text_config": {"max_position_embeddings": 2048}}),
        (bare, {}),
    ):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    assert real_model(flat, "bfloat16", 4096) == RealModel("bfloat16", 4096)
    assert real_model(nested, "float32", 4096) == RealModel("float32", 2048)
    assert real_model(bare, "bfloat16", 4096).context == 4096


def test_a_slice_past_the_traces_end_is_refused_with_the_offset_that_fits() -> None:
    """The benches replayed a shorter slice than asked for without a word (the trace's last 24 requests for
    ``--offset 3969 --count 48``)."""
    from kvrelay.sim.trace import TraceError, load_trace, trace_slice

    requests = load_trace(TRACE)
    assert len(requests) == 3993
    assert trace_slice(requests, 3969, 24) == list(requests[3969:])
    with pytest.raises(TraceError, match=r"past the trace's 3993 requests: use --offset 3945 or less"):
        trace_slice(requests, 3969, 48)
    with pytest.raises(TraceError, match="use a smaller --count"):
        trace_slice(requests, 0, 4000)
    with pytest.raises(TraceError, match="at least 0"):
        trace_slice(requests, -1, 24)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(TRACE))}: .* use --offset 3945 or less"):
        slice_prompts(TRACE, 3969, 48, tokenizer=None, scaling=Scaling(16, 512, 2048, 64, 1.0))
