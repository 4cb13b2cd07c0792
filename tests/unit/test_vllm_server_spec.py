"""A vLLM server's command line and environment: the model runs in the engine core's process unless asked not to."""

from __future__ import annotations

from kvrelay.launch.vllm_server import VllmServerSpec


def spec(**kw: object) -> VllmServerSpec:
    return VllmServerSpec(model="/models/tiny", port=8100, events_port=8101, python="/venv/bin/python", **kw)  # type: ignore[arg-type]


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
