"""A vLLM server's command line and environment: the model runs in the engine core's process unless asked not to."""

from __future__ import annotations

import json
from pathlib import Path

from kvrelay.engines.vllm.metrics import EngineFigures
from kvrelay.launch.vllm_server import VllmServerSpec, checkpoint_warning, has_sliding_window


def spec(**kw: object) -> VllmServerSpec:
    kw = {"model": "/models/tiny", **kw}
    return VllmServerSpec(port=8100, events_port=8101, python="/venv/bin/python", **kw)  # type: ignore[arg-type]


def test_by_default_the_model_runs_in_the_engine_cores_process() -> None:
    argv, env = spec().argv(), spec().env({})
    at = argv.index("--distributed-executor-backend")
    assert argv[at + 1] == "uni"
    # vLLM's CPU platform turns "uni" back into "mp" unless the engine's multiprocessing switch is off
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == "1"


def test_the_multiprocess_executor_is_vllms_own_default_when_asked_for() -> None:
    argv, env = spec(uniprocess=False).argv(), spec(uniprocess=False).env({})
    assert "--distributed-executor-backend" not in argv
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert argv[:4] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model"]


SIZES = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
}


def test_a_sliding_window_model_gets_a_prefix_cache_checkpoint_at_every_block(tmp_path: Path) -> None:
    """vLLM 0.32 keeps a sliding-window layer's KV only at a prompt's end and where two prompts part, unless the
    retention interval says otherwise; the router counts a hit at every block boundary, so the interval is one
    block for such models and absent (vLLM refuses it) for the others."""
    sizes = SIZES
    gemma3_text = {**sizes, "model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    configs = {
        "gemma3": {**sizes, "model_type": "gemma3_text", "sliding_window": 512},  # layers from the 5:1 pattern
        "gemma3-multimodal": {"model_type": "gemma3", "text_config": gemma3_text},
        "mistral": {**sizes, "model_type": "mistral", "sliding_window": 4096},
        "llama": {**sizes, "model_type": "llama"},
        "qwen2": {**sizes, "model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False},
        "qwen3": {**sizes, "model_type": "qwen3", "sliding_window": None},
    }
    flags = {}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        argv = spec(model=str(tmp_path / name), block_tokens=64).engine_argv()
        at = argv.index("--prefix-cache-retention-interval") if "--prefix-cache-retention-interval" in argv else None
        flags[name] = None if at is None else argv[at + 1]
    assert flags == {
        "gemma3": "64",
        "gemma3-multimodal": "64",
        "mistral": None,  # a bare window: vLLM may serve it as full attention and then refuses the flag
        "llama": None,
        "qwen2": None,
        "qwen3": None,
    }
    assert not has_sliding_window(tmp_path / "missing")


def test_a_worker_warns_of_an_engine_that_keeps_fewer_checkpoints_than_the_router_credits(tmp_path: Path) -> None:
    """A server started by hand without the retention flag: the warning names the fix; an engine with a
    checkpoint every block, one that does not say, and a model without sliding-window layers get none."""
    for name, config in {
        "gemma3": {**SIZES, "model_type": "gemma3_text"},
        "llama": {**SIZES, "model_type": "llama"},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    warnings = {
        (model, every): checkpoint_warning(tmp_path / model, EngineFigures(block_size=64, checkpoint_tokens=every))
        for model in ("gemma3", "llama")
        for every in (0, 64, 128, None)
    }
    assert warnings[("gemma3", 0)] is not None and warnings[("gemma3", 128)] is not None
    assert "only at a prompt's end" in warnings[("gemma3", 0)]
    assert "every 128 tokens" in warnings[("gemma3", 128)]
    for text in (warnings[("gemma3", 0)], warnings[("gemma3", 128)]):
        assert text.endswith("start it with --prefix-cache-retention-interval 64")
    assert {k for k, v in warnings.items() if v is not None} == {("gemma3", 0), ("gemma3", 128)}
