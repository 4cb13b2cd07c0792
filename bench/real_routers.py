"""A Mooncake trace slice replayed through kvrelay's router and the real peer routers, on two engines, quiet and
loaded.

Engines (``--engines``, both by default), two workers each:

- ``native``: kvrelay's own workers (``--model``, default Gemma 3 270M, bfloat16). kvrelay's router fronts them
  as ``kvrelay cluster --workers 2``; a peer router fronts two ``kvrelay serve`` processes, each the OpenAI HTTP
  face of one worker (as ``bench/trace_e2e.py`` does).
- ``vllm``: two vLLM OpenAI servers (CPU build from ``.venv-vllm``), started once for the whole run and emptied
  (``/reset_prefix_cache``) before every replay. The model is the vLLM tests' tiny random Llama
  (``kvrelay.testing.vllm``, float32, ``--vllm-blocks`` KV blocks of 64 tokens each): Gemma 3 270M takes vLLM
  minutes to start and seconds per prefill on this 2-core machine, which would not fit a run of minutes.
  A peer router fronts the servers themselves. kvrelay's router runs the same engines in its own process
  instead, vLLM's ``AsyncLLM`` without its OpenAI server (``kvrelay router --vllm-in-process 2``, run by vLLM's
  interpreter; the engine arguments are the servers'), started afresh for each replay; the shared servers idle
  meanwhile. ``kvrelay_over_http`` has it drive the servers from its process instead (``--vllm-engine
  URL,KV_EVENTS``, as ``kvrelay cluster --engine vllm`` deploys it).

Setups (``--setups``), each a router in front of the same engines, each replay starting cold:

1. ``kvrelay``: kvrelay's router, policy ``kvrelay`` (predicted TTFT, predict on route), as ``kvrelay cluster``
   deploys it;
2. ``smg``: SGLang Model Gateway (PyPI ``smg`` 1.13.0), ``smg launch --policy cache_aware``;
3. ``vllm_router``: vLLM's router (PyPI ``vllm-router`` 0.1.17), ``--policy cache_aware`` (its default);
4. ``sglang_router``: PyPI ``sglang-router`` 0.3.2, ``--policy cache_aware``;
5. ``round_robin``: kvrelay's router with policy ``round_robin``;
6. ``kvrelay_workers`` (not run unless named): kvrelay's router fronting the vLLM servers through one
   ``kvrelay worker --engine vllm`` process each (on the native engine the same as ``kvrelay``);
7. ``kvrelay_over_http`` (not run unless named): kvrelay's router driving the vLLM servers from its process
   (on the native engine the same as ``kvrelay``).

The peers are installed by ``make routers`` (``scripts/install_routers.sh``, one venv each under
``.venv-routers``); a peer that is not installed is left out, and the report says so.

Loads (``--loads``): ``quiet`` (nothing of the bench's own besides the setup) and ``loaded``: a CPU hog the
bench starts itself (``kvrelay.bench.background_load``: ``--hog-share`` of core ``--hog-cpu`` kept busy, in
20 ms cycles) for the whole loaded phase. Where the bench may (root), the scheduler's session autogroups are off
for the run (``background_load.autogroups_off``): with them on, the hog takes more from a setup whose processes
share a session (``kvrelay cluster``, an in-process vLLM engine's core beside the router) than from one whose
engines each have their own (the peers' servers); the report says which. In each (engine, load) phase every
setup replays the slice ``--rounds`` times in alternating order (A B C D E, then E D C B A, ...), samples pooled.

The slice and its scaling are ``bench/trace_e2e.py``'s (``kvrelay.bench.trace.prompts``): a 512-token trace
block becomes ``--block-tokens`` tokens, prompts are capped at ``--max-prompt-tokens``, outputs at
``--max-output-tokens``, arrivals stretched ``--time-stretch`` times (for the vLLM engine,
``--vllm-time-stretch``: the tiny model is far faster). Figures per (engine, load): TTFT p50/p90/p99 at the
client (streamed ``/v1/completions``), requests/s and output tokens/s, and prompt tokens served from cache from
the engines' own ``/metrics`` (vLLM's ``vllm:prefix_cache_hits``; kvrelay's ``kvrelay_cached_tokens``,
scraped around each replay), with usage ``cached_tokens`` beside it. Writes ``--json`` figures, a Markdown
report (``--md``), a TTFT CDF grid (``--png``) and the per-request measurements (``--requests-json``).

Run (about 40 minutes on the shared 2-core machine: both engines, quiet and loaded, two rounds; the vLLM engine
first):
``flock /tmp/kvrelay-heavy.lock .venv/bin/python bench/real_routers.py --json bench/results/real_routers.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvrelay.bench.background_load import autogroups_off, cpu_hog
from kvrelay.bench.trace.client import Measured, replay, wait_ready, warm_up
from kvrelay.bench.trace.decisions import routing_summary
from kvrelay.bench.trace.engine_metrics import scrape
from kvrelay.bench.trace.faces import CLUSTER_READY, Face, FaceOptions, kvrelay_cluster, serve_workers, start_peer
from kvrelay.bench.trace.faces import until as face_until
from kvrelay.bench.trace.peers import Peer, find_peer
from kvrelay.bench.trace.prompts import Scaling, TracePrompt, slice_prompts
from kvrelay.bench.trace.real_routers_report import Phase, Replay, figures, markdown, plot_grid

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
ENGINES = ("native", "vllm")
LOADS = ("quiet", "loaded")
SETUPS = ("kvrelay", "smg", "vllm_router", "sglang_router", "round_robin", "kvrelay_workers", "kvrelay_over_http")
PEERS = {"smg": Peer.SMG, "vllm_router": Peer.VLLM_ROUTER, "sglang_router": Peer.SGLANG_ROUTER}
KVRELAY_POLICIES = {
    "kvrelay": "kvrelay",
    "round_robin": "round_robin",
    "kvrelay_workers": "kvrelay",
    "kvrelay_over_http": "kvrelay",
}
LABELS = {
    "kvrelay": "kvrelay router (policy kvrelay)",
    "smg": "SGLang Model Gateway 1.13.0 cache_aware",
    "vllm_router": "vllm-router 0.1.17 cache_aware",
    "sglang_router": "sglang-router 0.3.2 cache_aware",
    "round_robin": "kvrelay router (policy round_robin)",
    "kvrelay_workers": "kvrelay router through a worker process per engine",
    "kvrelay_over_http": "kvrelay router driving vLLM's OpenAI servers",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--offset", type=int, default=3969, help="first request of the slice (timestamp order)")
    p.add_argument("--count", type=int, default=24, help="requests in the slice")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block here (the trace's: 512)")
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--time-stretch", type=float, default=4.0, help="wall s per trace s, native engine")
    p.add_argument("--vllm-time-stretch", type=float, default=0.5, help="wall s per trace s, vLLM engine")
    p.add_argument("--model", default=None, help="native engine: model directory or GGUF (default: Gemma 3 270M)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--kv-tokens", type=int, default=65536, help="native engine: KV tokens per worker")
    p.add_argument("--lanes", type=int, default=16, help="native engine: concurrent sequences per worker")
    p.add_argument(
        "--vllm-model",
        default=None,
        help="vLLM engine: a model directory or .gguf, or 'default' for kvrelay's default model (Gemma 3 270M), "
        "served at --dtype (default: the vLLM tests' tiny random Llama, float32)",
    )
    p.add_argument("--vllm-context", type=int, default=4096, help="vLLM engine: context of a --vllm-model's engines")
    p.add_argument("--vllm-blocks", type=int, default=256, help="vLLM engine: KV blocks of 64 tokens per server")
    p.add_argument("--engines", default="vllm,native", help=f"comma-separated subset of {', '.join(ENGINES)}")
    p.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated subset of {', '.join(LOADS)}")
    p.add_argument("--setups", default=",".join(SETUPS[:-2]), help=f"comma-separated subset of {', '.join(SETUPS)}")
    p.add_argument("--rounds", type=int, default=2, help="replays per setup and phase, in alternating order")
    p.add_argument("--hog-share", type=float, default=0.5, help="loaded phase: share of one core kept busy")
    p.add_argument("--hog-cpu", type=int, default=0, help="loaded phase: the core the hog is pinned to")
    p.add_argument("--routers-venvs", type=Path, default=None, help="where `make routers` put the peers")
    p.add_argument(
        "--from-requests",
        default=None,
        help="run nothing: report the phases of these saved .requests.json files (comma-separated), in order",
    )
    p.add_argument("--keep-dir", default=None, help="keep every replay's home (logs, fact stores) under this")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--md", default=None, help="Markdown report (default: the JSON path with .md)")
    p.add_argument("--png", default=None, help="TTFT CDF grid (default: the JSON path with .png)")
    p.add_argument("--requests-json", default=None, help="per-request measurements (default: JSON path .requests.json)")
    return p.parse_args(argv)


def _subset(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [v for v in value.split(",") if v]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: unknown or empty {unknown or chosen}; choose from {', '.join(allowed)}")
    return chosen


def build_prompts(args: argparse.Namespace, tokenizer: Any, scaling: Scaling) -> list[TracePrompt]:
    from kvrelay.sim.trace import TraceError

    try:
        return slice_prompts(args.trace, args.offset, args.count, tokenizer, scaling)
    except TraceError as exc:
        raise SystemExit(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Started:
    """A setup ready to replay: its face and the URLs whose ``/metrics`` count its engines' cached tokens (none:
    engines in the router's process, whose usage reports the engines' own counts)."""

    face: Face
    metrics_urls: list[str]


async def replay_setup(name: str, start: Any, home: Path, model: str, prompts: list[TracePrompt], timeout_s: float):
    """Start the setup (``start(name, home)``), warm it up, replay the prompts, stop it: one ``Replay``."""
    started: Started = await start(name, home)
    face = started.face
    try:
        await warm_up(face.url, model)
        cached0 = scrape(started.metrics_urls)
        run0, wait0 = face.sched_seconds()
        cpu0 = face.cpu_seconds()
        clock = time.perf_counter()
        measured = await replay(face.url, model, prompts, timeout_s)
        elapsed = time.perf_counter() - clock
        run1, wait1 = face.sched_seconds()
        cached = (
            scrape(started.metrics_urls) - cached0 if started.metrics_urls else sum(m.cached_tokens for m in measured)
        )
        counters = _router_counters(face.url) if name in KVRELAY_POLICIES else {}
        cpu = {role: round(seconds - cpu0.get(role, 0.0), 1) for role, seconds in face.cpu_seconds().items()}
    except BaseException:
        print(f"  {name} failed; logs: {face.logs()}", flush=True)
        raise
    finally:
        face.stop()
    availability = (run1 - run0) / max(1e-9, run1 - run0 + wait1 - wait0)
    stores = {p.name: p for p in home.rglob("facts.sqlite3")}
    routing = {**routing_summary(stores), "router_counters": counters} if name in KVRELAY_POLICIES else {}
    errors = sum(m.error is not None for m in measured)
    print(
        f"  {name}: {len(prompts)} requests in {elapsed:.1f} s, {errors} errors, engine-cached {cached:.0f} tokens, "
        f"workers' CPU availability {availability:.2f}; CPU s during the replay by process {cpu}; {routing}",
        flush=True,
    )
    return Replay(name, measured, availability, cached, routing)


def _router_counters(url: str) -> dict[str, int]:
    """kvrelay's router's counters (parked, offer timeouts, declines...) from its ``/cluster``."""
    import httpx

    try:
        return dict(httpx.get(url + "/cluster", timeout=10).json().get("router_counters", {}))
    except (httpx.HTTPError, ValueError):
        return {}


def native_starter(args: argparse.Namespace, options: FaceOptions, model: str, peers: dict[str, str]):
    async def start(name: str, home: Path) -> Started:
        if name in KVRELAY_POLICIES:
            face = kvrelay_cluster(name, KVRELAY_POLICIES[name], options, home)
            try:
                await face_until(lambda: face.log_has("cluster", CLUSTER_READY), face, 300.0)
                await wait_ready(face.url, model, face)
            except BaseException:
                face.stop()
                raise
            return Started(face, [face.url])
        face, urls = serve_workers(name, options, home)
        try:
            for url in urls:
                await wait_ready(url, model, face)
            start_peer(face, PEERS[name], peers[name], "cache_aware", urls)
            await wait_ready(face.url, model, face)
        except BaseException:
            face.stop()
            raise
        return Started(face, urls)

    return start


def vllm_starter(engines: list[Any], model_dir: Path, peers: dict[str, str]):
    from kvrelay.bench.trace.vllm_engines import empty_caches, kvrelay_in_process, kvrelay_over_vllm, peer_face

    async def start(name: str, home: Path) -> Started:
        empty_caches(engines)
        urls = [e.spec.url for e in engines]
        if name in ("kvrelay", "round_robin"):
            face = kvrelay_in_process(name, KVRELAY_POLICIES[name], engines, model_dir, home)
            urls = []
        elif name in KVRELAY_POLICIES:
            attached = name != "kvrelay_workers"
            face = kvrelay_over_vllm(name, KVRELAY_POLICIES[name], engines, model_dir, home, attached)
        else:
            face, _ = peer_face(name, engines, home)
            start_peer(face, PEERS[name], peers[name], "cache_aware", urls)
        try:
            await wait_ready(face.url, model_dir.name, face)
        except BaseException:
            face.stop()
            raise
        return Started(face, urls)

    return start


def run_phases(
    engine: str,
    start: Any,
    model: str,
    prompts: list[TracePrompt],
    setups: list[str],
    args: argparse.Namespace,
    work: Path,
    phases: list[Phase],
    save: Callable[[], None],
) -> None:
    """Every load of ``--loads`` on one engine: each setup ``--rounds`` times in alternating order; each phase
    is appended to ``phases`` and ``save``d as soon as it is done."""
    for load in _subset(args.loads, LOADS, "--loads"):
        hog: AbstractContextManager[Any] = cpu_hog(args.hog_share, args.hog_cpu) if load == "loaded" else nullcontext()
        replays: dict[str, list[Replay]] = {name: [] for name in setups}
        with hog:
            for round_ in range(args.rounds):
                for name in setups if round_ % 2 == 0 else setups[::-1]:
                    print(f"{engine}/{load}: setup {name} (round {round_ + 1}) ...", flush=True)
                    home = work / f"{engine}-{load}-{name}-{round_}"
                    replays[name].append(asyncio.run(replay_setup(name, start, home, model, prompts, args.timeout_s)))
        phases.append(Phase(engine, load, replays))
        save()


@contextmanager
def _work_dir(keep: str | None) -> Iterator[Path]:
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="kvrelay-real-routers-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def run_native(
    args: argparse.Namespace,
    setups: list[str],
    peers: dict[str, str],
    work: Path,
    phases: list[Phase],
    save: Callable[[], None],
) -> str:
    import torch

    from kvrelay.models.loading.loader import load_artifacts

    artifacts = load_artifacts(args.model, dtype=torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    scaling = Scaling(args.block_tokens, 512, args.max_prompt_tokens, args.max_output_tokens, args.time_stretch)
    prompts = build_prompts(args, artifacts.tokenizer, scaling)
    options = FaceOptions(args.model, args.dtype, args.kv_tokens, args.lanes, 1)
    start = native_starter(args, options, artifacts.name, peers)
    run_phases("native", start, artifacts.name, prompts, setups, args, work, phases, save)
    return (
        f"native: {artifacts.name} ({args.dtype}) on kvrelay's runtime, 2 workers of {args.lanes} lanes and "
        f"{args.kv_tokens} KV tokens, 1 torch thread each; {_slice_note(prompts, scaling)}"
    )


def run_vllm(
    args: argparse.Namespace,
    setups: list[str],
    peers: dict[str, str],
    work: Path,
    phases: list[Phase],
    save: Callable[[], None],
) -> str:
    from transformers import AutoTokenizer

    from kvrelay.bench.trace.vllm_engines import real_model, shared_engines
    from kvrelay.models.loading.loader import model_directory
    from kvrelay.testing.vllm import TINY_CONTEXT, VLLM_BLOCK_TOKENS, make_vllm_tiny_model

    if args.vllm_model is None:
        model_dir, real = make_vllm_tiny_model(work / "tiny-llama"), None
        context, what = TINY_CONTEXT, "the tiny random Llama of the vLLM tests (float32"
    else:
        model_dir = model_directory(None if args.vllm_model == "default" else args.vllm_model)
        real = real_model(model_dir, args.dtype, args.vllm_context)
        context, what = real.context, f"{model_dir} ({args.dtype}, context {real.context}"
    cap = min(args.max_prompt_tokens, context - args.max_output_tokens - 8)
    scaling = Scaling(args.block_tokens, 512, cap, args.max_output_tokens, args.vllm_time_stretch)
    prompts = build_prompts(args, AutoTokenizer.from_pretrained(model_dir), scaling)
    print(f"vllm: starting 2 vLLM servers of {model_dir} ...", flush=True)
    with shared_engines(model_dir, 2, args.vllm_blocks, work / "vllm-logs", real) as engines:
        start = vllm_starter(engines, model_dir, peers)
        run_phases("vllm", start, model_dir.name, prompts, setups, args, work, phases, save)
    return (
        f"vllm: vLLM {_vllm_version()} CPU build, 2 OpenAI servers of {what}, eager, prefix caching, "
        f"{args.vllm_blocks} KV blocks of {VLLM_BLOCK_TOKENS} tokens each); {_slice_note(prompts, scaling)}"
    )


def _vllm_version() -> str:
    from kvrelay.launch.vllm_server import vllm_python

    found = sorted(Path(vllm_python()).parents[1].glob("lib/python*/site-packages/vllm*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-")[1] if found else "(version unknown)"


def _slice_note(prompts: list[TracePrompt], scaling: Scaling) -> str:
    tokens = sum(len(p.token_ids) for p in prompts)
    return (
        f"{len(prompts)} requests (trace lines {prompts[0].line}..{prompts[-1].line}), {tokens} prompt tokens, "
        f"arrivals over {max(p.arrival_s for p in prompts):.1f} s (x{scaling.time_stretch:g}), a trace block = "
        f"{scaling.block_tokens} tokens, prompts capped at {scaling.max_prompt_tokens}, outputs at "
        f"{scaling.max_output_tokens}."
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = _subset(args.engines, ENGINES, "--engines")
    setups = _subset(args.setups, SETUPS, "--setups")
    if "kvrelay" not in setups:
        raise SystemExit("--setups must include kvrelay: every figure compares it with the others")
    notes: list[str] = []
    peers: dict[str, str] = {}
    for name, peer in PEERS.items():
        exe = find_peer(peer, args.routers_venvs) if name in setups else None
        if exe:
            peers[name] = exe
        elif name in setups:
            setups.remove(name)
            notes.append(f"{peer.value} is not installed (`make routers`): the {name} setup is left out.")
            print(notes[-1], flush=True)
    phases: list[Phase] = []
    out = Path(args.json) if args.json else None
    if args.from_requests:
        for path in args.from_requests.split(","):
            saved = json.loads(Path(path).read_text())
            phases += [_phase_of(p) for p in saved["phases"]]
            notes += saved["notes"]
    else:
        saved_at = Path(args.requests_json or out.with_suffix(".requests.json")) if out is not None else None

        def save() -> None:  # the measurements first, phase by phase, so a later failure cannot lose them
            if saved_at is not None:
                saved_at.parent.mkdir(parents=True, exist_ok=True)
                saved = {"phases": [_phase_json(p) for p in phases], "notes": notes}
                saved_at.write_text(json.dumps(saved) + "\n")

        with _work_dir(args.keep_dir) as work, autogroups_off() as autogroups:
            notes.append(f"Scheduler session autogroups: {autogroups.value} (kvrelay.bench.background_load).")
            for engine in engines:
                notes.append((run_native if engine == "native" else run_vllm)(args, setups, peers, work, phases, save))
                save()
    rounds = "/".join(str(n) for n in sorted({len(runs) for p in phases for runs in p.replays.values()}))
    notes += [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, shared with other work; loaded: a hog keeping "
        f"{args.hog_share:g} of core {args.hog_cpu} busy; {rounds} replays per setup and phase, alternating.",
        "TTFT: client-side, request sent to the first streamed chunk with a token (its text may be empty, as "
        "vLLM's serving benchmark counts it). Engine-cached: prompt tokens served from cache by the engines' own "
        "/metrics (vllm:prefix_cache_hits_total; kvrelay_cached_tokens_total), summed "
        "over the replays; usage-cached: the responses' usage.prompt_tokens_details.cached_tokens.",
    ]
    text = markdown(phases, LABELS, notes)
    print(text)
    if out is not None:
        out.write_text(json.dumps(figures(phases), indent=1) + "\n")
        Path(args.md or out.with_suffix(".md")).write_text(text)
        plot_grid(args.png or out.with_suffix(".png"), phases, LABELS)
        print(f"wrote {out} and its .md, .png, .requests.json")
    return 0


def _phase_of(saved: dict[str, Any]) -> Phase:
    replays = {
        name: [Replay(**{**r, "measured": [Measured(**m) for m in r["measured"]]}) for r in runs]
        for name, runs in saved["replays"].items()
    }
    return Phase(saved["engine"], saved["load"], replays)


def _phase_json(phase: Phase) -> dict[str, Any]:
    return {
        "engine": phase.engine,
        "load": phase.load,
        "replays": {
            name: [{**asdict(replace(r, measured=[])), "measured": [asdict(m) for m in r.measured]} for r in runs]
            for name, runs in phase.replays.items()
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
