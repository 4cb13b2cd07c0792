"""The process faces: configuration precedence, ``--help``, the router's model catalog, and ``kvrelay cluster``
with a graceful worker drain."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from kvrelay.cli import cluster as cluster_cli
from kvrelay.cli import router as router_cli
from kvrelay.cli import worker as worker_cli
from kvrelay.cli.main import COMMANDS, build_parser
from kvrelay.launch import catalog
from kvrelay.launch.catalog import ModelCatalog, load_served_model
from kvrelay.launch.config import ConfigError, add_options, resolve
from kvrelay.models.loading.weight_layout import ModelLoadError
from kvrelay.protocol.messages import Heartbeat
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import (
    CLUSTER_READY,
    StreamingRequest,
    children_of,
    complete,
    two_worker_cluster,
    wait_until,
)
from tests.support.tiny_gguf import write_tiny_gguf

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4
BUDGET = 300


def parse(module: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_options(parser, module.COMMAND, module.OPTIONS)  # type: ignore[attr-defined]
    return parser.parse_args(argv)


def router_values(argv: list[str], env: dict[str, str]) -> dict[str, object]:
    return resolve(parse(router_cli, argv), "router", router_cli.OPTIONS, env)


def test_flags_beat_environment_beat_toml_beat_defaults(tmp_path: Path) -> None:
    config = tmp_path / "kvrelay.toml"
    config.write_text(
        '[router]\nport = 7100\nworker_port = 7101\nhost = "127.0.0.2"\noffer_timeout_s = 0.5\n[worker]\nlanes = 3\n'
    )
    env = {"KVRELAY_PORT": "7200", "KVRELAY_WORKER_PORT": "7201"}
    values = router_values(["--config", str(config), "--port", "7300"], env)
    assert values["port"] == 7300  # flag over environment and TOML
    assert values["worker_port"] == 7201  # environment over TOML
    assert values["host"] == "127.0.0.2" and values["offer_timeout_s"] == 0.5  # TOML over default
    assert values["worker_expiry_s"] == 3.0  # default
    assert router_values([], {"KVRELAY_CONFIG": str(config)})["port"] == 7100  # the file named by the environment
    worker = resolve(parse(worker_cli, ["--config", str(config)]), "worker", worker_cli.OPTIONS, {})
    assert worker["lanes"] == 3 and worker["kv_tokens"] == 65536  # each face reads its own table


def test_repeated_options_from_each_source(tmp_path: Path) -> None:
    config = tmp_path / "kvrelay.toml"
    config.write_text('[worker]\nrouter = ["ws://a:1/workers", "ws://b:2/workers"]\n')
    args = ["--config", str(config)]
    from_toml = resolve(parse(worker_cli, args), "worker", worker_cli.OPTIONS, {})
    assert from_toml["router"] == ["ws://a:1/workers", "ws://b:2/workers"]
    from_env = resolve(parse(worker_cli, args), "worker", worker_cli.OPTIONS, {"KVRELAY_ROUTER": "ws://c:3, ws://d:4"})
    assert from_env["router"] == ["ws://c:3", "ws://d:4"]
    flags = parse(worker_cli, [*args, "--router", "ws://e:5", "--router", "ws://f:6"])
    assert resolve(flags, "worker", worker_cli.OPTIONS, {})["router"] == ["ws://e:5", "ws://f:6"]


def test_bad_values_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\$KVRELAY_PORT='eighty' is not a valid port"):
        router_values([], {"KVRELAY_PORT": "eighty"})
    config = tmp_path / "bad.toml"
    config.write_text("[router]\nprot = 80\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) prot in \[router\].*known keys: .*port"):
        router_values(["--config", str(config)], {})
    config.write_text("[router\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        router_values(["--config", str(config)], {})
    with pytest.raises(ConfigError, match="cannot read the config file"):
        router_values(["--config", str(tmp_path / "missing.toml")], {})
    config.write_text('[worker]\ndtype = "float16"\n')
    with pytest.raises(ConfigError, match="worker.dtype .* is not one of float32, bfloat16"):
        resolve(parse(worker_cli, ["--config", str(config)]), "worker", worker_cli.OPTIONS, {})


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"router", "worker", "cluster"} <= set(COMMANDS)
    for module in (router_cli, worker_cli, cluster_cli):
        with pytest.raises(SystemExit):
            build_parser().parse_args([module.COMMAND, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for option in module.OPTIONS:
            assert option.flag in text and option.env in text and f"{module.COMMAND}.{option.name}" in text
        assert "--config" in text and "precedence" in text


def test_worker_without_a_router_url_says_how_to_give_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["worker"])
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVRELAY_")}
    os.environ["KVRELAY_SECRET"] = "s" * 32
    try:
        assert worker_cli.run(args) == 2
    finally:
        del os.environ["KVRELAY_SECRET"]
        os.environ.update(saved)
    assert "no router URL: pass --router ws://HOST:PORT/workers" in capsys.readouterr().err


def test_engine_flags_that_cannot_work_name_the_fix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = build_parser().parse_args(["worker", "--router", "ws://127.0.0.1:1/workers", "--engine", "vllm"])
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVRELAY_")}
    os.environ["KVRELAY_SECRET"] = "s" * 32
    try:
        assert worker_cli.run(args) == 2
        assert "--engine vllm needs --engine-url http://HOST:PORT" in capsys.readouterr().err
        cluster = build_parser().parse_args(["cluster", "--engine", "vllm", "--model", str(tmp_path / "absent")])
        assert cluster_cli.run(cluster) == 2
        assert "--engine vllm needs --model DIR" in capsys.readouterr().err
    finally:
        del os.environ["KVRELAY_SECRET"]
        os.environ.update(saved)


def heartbeat(worker_id: str, model: str, context_limit: int) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, epoch=1, seq=1, models=(model,), pages_total=64, pages_free=64, context_limit=context_limit
    )


def test_a_model_is_served_once_a_worker_announces_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    served = load_served_model(str(make_tiny_model("llama", tmp_path / "tiny")))
    assert served.name == "tiny" and served.context_limit == 512 and served.tokenizer.encode("hello")
    models = ModelCatalog({served.name: served})
    assert models.served == {}
    models.learn(heartbeat("w1", "tiny", 256))
    models.learn(heartbeat("w2", "tiny", 384))
    assert models.served["tiny"].context_limit == 384  # the largest any worker takes, within the model's own
    with caplog.at_level(logging.WARNING):
        models.learn(heartbeat("w3", "other", 256))
        models.learn(heartbeat("w3", "other", 256))
    assert "other" not in models.served
    warnings = [r.getMessage() for r in caplog.records if "other" in r.getMessage()]
    assert len(warnings) == 1 and "--model SOURCE" in warnings[0]


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = write_tiny_gguf(make_tiny_model("llama", tmp_path / "src"), tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    first = load_served_model(str(gguf_path), cache)
    assert first.name == "tiny" and first.architecture == "llama"

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(catalog, "load_artifacts", no_conversion)
    again = load_served_model(str(gguf_path), cache)
    assert again.tokenizer.encode("the capital of France") == first.tokenizer.encode("the capital of France")


def test_a_missing_source_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a model directory nor a .gguf file"):
        load_served_model(str(tmp_path / "nothing"))


@pytest.mark.timeout(150)
def test_cluster_runs_named_workers_drains_one_on_sigterm_and_stops_all(tmp_path: Path) -> None:
    model = make_tiny_model(
        "llama",
        tmp_path / "slowllama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        max_position_embeddings=2048,
        eos_token_id=None,
    )
    cluster = two_worker_cluster(tmp_path, model, "--grace-s", "0.5")
    try:
        http_url = cluster.wait_for(CLUSTER_READY, 120).group(1)
        children = children_of(cluster.pid)
        workers = {
            re.search(r"--worker-id (w\d)", c).group(1): pid  # type: ignore[union-attr]
            for pid, c in children.items()
            if " worker " in c
        }
        assert sorted(workers) == ["w1", "w2"] and len(children) == 3
        assert any(" router " in c for c in children.values())
        reference = complete(http_url, model.name, PROMPT, BUDGET)["choices"][0]["text"]

        request = StreamingRequest(http_url, model.name, PROMPT, BUDGET)
        assert request.first.wait(60)
        state = wait_until(
            lambda: next(iter(httpx.get(http_url + "/cluster").json()["requests"].values()), None),
            10,
            "the request in flight",
        )
        draining = state["worker_id"]
        mark = cluster.mark()
        os.kill(workers[draining], signal.SIGTERM)
        assert request.result(90) == reference and request.usage["completion_tokens"] == BUDGET  # type: ignore[index]
        cluster.wait_for(rf"worker {draining} handed over 1 assignments as continuations", 30, mark)
        cluster.wait_for(rf"worker {draining} exited with code 0", 30, mark)
        counters = httpx.get(http_url + "/cluster").json()["router_counters"]
        assert counters.get("worker_cancelled", 0) + counters.get("worker_lost_assignments", 0) >= 1

        cluster.signal(signal.SIGTERM)
        assert cluster.process.wait(60) == 0
        assert not children_of(cluster.pid)
        assert all(not Path(f"/proc/{pid}").exists() for pid in children)
    finally:
        cluster.stop()
