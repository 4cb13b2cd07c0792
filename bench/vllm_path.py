"""Where a request's time goes on the way through kvrelay to one vLLM engine, against the same engine direct.

One vLLM OpenAI server of the vLLM tests' tiny random Llama (``kvrelay.testing.vllm``) and, in front of it,
``kvrelay router`` with one ``kvrelay worker --engine vllm`` (``kvrelay.bench.trace.vllm_engines``). Three
targets take turns, request by request (A B C, then C B A, ...), each with its own prompts of the same length
(so every one is cold, or warm by the same prefix):

- ``direct``: the engine's ``/v1/completions`` with the text prompt, as a peer router sends it;
- ``direct_ids``: the engine with the token-id prompt and ``return_token_ids``, as kvrelay's vLLM worker sends it;
- ``kvrelay``: kvrelay's router with the text prompt.

Phases (``--phases``): ``cold`` (sequential, distinct prompts), ``warm`` (sequential, each prompt sharing all
but its last block with a cold one sent before: the engine holds that prefix), ``burst`` (``--burst`` requests
of one target at once, then the next target's). TTFT is taken at the client to the first streamed chunk that
carries text. For the kvrelay requests the router's fact store splits it (all on the machine's monotonic
clock): ingress (request sent to the router's decision), offer (decision to the worker's acceptance arriving
at the router), worker (the worker's acceptance to its first token, as the worker measures it) and relay (the
rest: the first token to the client's first text chunk, minus the accept message's trip back). The router's
and worker's CPU seconds during the run are reported too.

Run (about 3 minutes; a vLLM start is most of it):
``flock /tmp/kvrelay-heavy.lock .venv/bin/python bench/vllm_path.py --json /tmp/vllm_path.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvrelay.bench.trace.prompts import PromptBuilder, Scaling, TracePrompt
from kvrelay.sim.trace import TraceRequest

TARGETS = ("direct", "direct_ids", "kvrelay")
PHASES = ("cold", "warm", "burst")


@dataclass(frozen=True, slots=True)
class Sent:
    target: str
    phase: str
    sent: float
    """time.monotonic() when sent."""
    first_text: float | None
    request_id: str
    cached: int
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.sent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=8, help="requests per target in each sequential phase")
    p.add_argument("--burst", type=int, default=4, help="requests sent at once in the burst phase")
    p.add_argument("--bursts", type=int, default=3, help="bursts per target")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--blocks", type=int, default=1024, help="the engine's KV blocks of 64 tokens")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--keep-dir", default=None, help="keep the logs and the router's fact store here")
    p.add_argument("--profile", default=None, help="py-spy the router and the worker into DIR (collapsed stacks)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], target: str, phase: str) -> Sent:
    sent = time.monotonic()
    first: float | None = None
    rid, cached, error = "", 0, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return Sent(target, phase, sent, None, "", 0, f"HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rid = rid or str(chunk.get("id", "")).removeprefix("cmpl-")
                if first is None and chunk.get("choices"):  # a token; its text may be empty, as vLLM's benchmark counts
                    first = time.monotonic()
                if chunk.get("usage"):
                    cached = int((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Sent(target, phase, sent, first, rid, cached, error or (None if first else "no token streamed"))


def body_for(target: str, model: str, prompt: TracePrompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt.text,
        "max_tokens": prompt.max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target == "direct_ids":
        body.update(prompt=list(prompt.token_ids), return_token_ids=True, ignore_eos=True)
    return body


def make_prompts(tokenizer: Any, args: argparse.Namespace) -> dict[tuple[str, str], list[TracePrompt]]:
    """Per (phase, target): its prompts; a warm prompt shares all but its last 64-token block with a cold one."""
    blocks = max(2, args.prompt_tokens // 64)
    scaling = Scaling(64, 64, args.prompt_tokens, args.max_tokens, 1.0)
    builder = PromptBuilder(tokenizer, scaling)
    out: dict[tuple[str, str], list[TracePrompt]] = {}
    serial = 0
    for phase, n in (("cold", args.count), ("burst", args.burst * args.bursts)):
        for target in TARGETS:
            reqs = []
            for _ in range(n):
                serial += 1
                ids = tuple(serial * 1000 + j for j in range(blocks))
                reqs.append(TraceRequest(serial, 0.0, args.prompt_tokens, args.max_tokens, ids))
            out[phase, target] = builder.build(reqs)
    for target in TARGETS:
        reqs = []
        for prompt in out["cold", target]:
            serial += 1
            ids = tuple((prompt.line * 1000 + j) if j < blocks - 1 else serial * 1000 for j in range(blocks))
            reqs.append(TraceRequest(serial, 0.0, args.prompt_tokens, args.max_tokens, ids))
        out["warm", target] = builder.build(reqs)
    return out


async def run_phases(
    urls: dict[str, str], model: str, prompts: dict[tuple[str, str], list[TracePrompt]], args: argparse.Namespace
) -> list[Sent]:
    out: list[Sent] = []
    phases = [p for p in args.phases.split(",") if p]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for phase in phases:
            if phase == "burst":
                for b in range(args.bursts):
                    for target in TARGETS if b % 2 == 0 else TARGETS[::-1]:
                        batch = prompts["burst", target][b * args.burst : (b + 1) * args.burst]
                        bodies = [body_for(target, model, p) for p in batch]
                        out += await asyncio.gather(*(send(client, urls[target], x, target, phase) for x in bodies))
                continue
            for i in range(args.count):
                for target in TARGETS if i % 2 == 0 else TARGETS[::-1]:
                    body = body_for(target, model, prompts[phase, target][i])
                    out.append(await send(client, urls[target], body, target, phase))
    return out


def hops(store: Path, sent: list[Sent], limit_s: float = 30.0) -> dict[str, dict[str, float]]:
    """Per kvrelay request id: its hops (module docstring), once the fact store holds its outcome."""
    ids = {s.request_id: s for s in sent if s.target == "kvrelay" and s.first_text is not None}
    deadline = time.monotonic() + limit_s
    while True:
        rows: list[tuple[Any, ...]] = []
        if store.is_file():
            with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
                rows = db.execute(
                    "SELECT d.request_id, MIN(d.time), MAX(d.outcome_time), o.ttft_s FROM decisions d JOIN outcomes o "
                    "ON d.request_id = o.request_id AND d.attempt = o.attempt WHERE d.outcome = 'accepted' "
                    "GROUP BY d.request_id"
                ).fetchall()
        found = {r[0]: r for r in rows if r[0] in ids and None not in r}
        if len(found) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out = {}
    for rid, (_, decided, accepted, worker) in found.items():
        s = ids[rid]
        assert s.first_text is not None
        out[rid] = {
            "ingress": decided - s.sent,
            "offer": accepted - decided,
            "worker": worker,
            "relay": s.first_text - accepted - worker,
        }
    return out


def summary(sent: list[Sent], split: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    rows = []
    for phase in PHASES:
        for target in TARGETS:
            mine = [s for s in sent if s.phase == phase and s.target == target]
            ttfts = [s.ttft for s in mine if s.ttft is not None]
            if not mine:
                continue
            row: dict[str, Any] = {
                "phase": phase,
                "target": target,
                "n": len(mine),
                "errors": sum(s.error is not None for s in mine),
                "ttft_p50": statistics.median(ttfts) if ttfts else None,
                "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
                "ttft_max": max(ttfts, default=None),
                "cached_mean": statistics.fmean(s.cached for s in mine),
            }
            if target == "kvrelay":
                parts = [split[s.request_id] for s in mine if s.request_id in split]
                for hop in ("ingress", "offer", "worker", "relay"):
                    row[hop + "_p50"] = statistics.median(p[hop] for p in parts) if parts else None
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = [
        "| phase | target | n | err | TTFT p50 ms | mean | max | ingress p50 | offer p50 | worker p50 | relay p50 "
        "| cached |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['target']} | {r['n']} | {r['errors']} | {f(r['ttft_p50'])} | {f(r['ttft_mean'])} | "
            f"{f(r['ttft_max'])} | {f(r.get('ingress_p50'))} | {f(r.get('offer_p50'))} | "
            f"{f(r.get('worker_p50'))} | {f(r.get('relay_p50'))} | {r['cached_mean']:.0f} |"
        )
    return "\n".join(lines)


def start_profiles(face: Any, out: Path) -> list[subprocess.Popen[bytes]]:
    """py-spy (from this Python's bin directory) recording each of the face's processes until SIGINT."""
    out.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).parent / "py-spy")
    return [
        subprocess.Popen(
            [spy, "record", "--format", "raw", "--rate", "200", "-o", str(out / f"{name}.txt"), "-p", str(p.pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, p in face.processes
    ]


def metrics_cost(url: str, polls: int = 20) -> str:
    """What one ``/metrics`` poll of the engine costs, whole and as the worker asks for it (``metrics.NAMES``):
    its size, the GET's time, the worker's parse."""
    from kvrelay.engines.vllm.metrics import NAMES, parse_metrics

    out = []
    with httpx.Client(timeout=10) as client:
        for label, params in (("whole", None), ("names", [("name[]", n) for n in NAMES])):
            gets, parses, size = [], [], 0
            for _ in range(polls):
                t0 = time.perf_counter()
                text = client.get(url + "/metrics", params=params).text
                t1 = time.perf_counter()
                parse_metrics(text)
                parses.append(time.perf_counter() - t1)
                gets.append(t1 - t0)
                size = len(text)
            out.append(
                f"/metrics {label}: {size} bytes, GET p50 {statistics.median(gets) * 1000:.1f} ms, "
                f"parse p50 {statistics.median(parses) * 1000:.2f} ms"
            )
    return "; ".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from kvrelay.bench.trace.client import wait_ready
    from kvrelay.bench.trace.vllm_engines import kvrelay_over_vllm, shared_engines
    from kvrelay.testing.vllm import make_vllm_tiny_model

    work = Path(args.keep_dir or tempfile.mkdtemp(prefix="kvrelay-vllm-path-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_vllm_tiny_model(work / "tiny-llama")
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args)
    with shared_engines(model_dir, 1, args.blocks, work / "vllm-logs") as engines:
        face = kvrelay_over_vllm("kvrelay", "kvrelay", engines, model_dir, work / "kvrelay")
        try:
            asyncio.run(wait_ready(face.url, model_dir.name, face))
            urls = {"direct": engines[0].spec.url, "direct_ids": engines[0].spec.url, "kvrelay": face.url}
            cpu0 = face.cpu_seconds()
            spies = [] if args.profile is None else start_profiles(face, Path(args.profile))
            sent = asyncio.run(run_phases(urls, model_dir.name, prompts, args))
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
            cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in face.cpu_seconds().items()}
            print(metrics_cost(engines[0].spec.url))
        finally:
            face.stop()
    stores = list((work / "kvrelay").rglob("facts.sqlite3"))
    split = hops(stores[0], sent) if stores else {}
    rows = summary(sent, split)
    print(table(rows))
    print(f"CPU seconds during the run by process: {cpu}")
    for s in sent:
        if s.error:
            print(f"  {s.phase}/{s.target}: {s.error}")
    if args.json:
        figures = [
            {
                "name": f"{r['phase']}/{r['target']}/ttft_p50",
                "value": r["ttft_p50"],
                "unit": "s",
                "baseline": "direct",
                "baseline_value": next(
                    (d["ttft_p50"] for d in rows if d["phase"] == r["phase"] and d["target"] == "direct"), None
                ),
            }
            for r in rows
        ]
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
        Path(args.json).with_suffix(".rows.json").write_text(json.dumps({"rows": rows, "cpu_s": cpu}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
