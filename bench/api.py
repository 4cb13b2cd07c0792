"""Benchmark of the HTTP layer's added latency (OpenAI-compatible API over the in-process router).

A tiny random Gemma 3 (so the model is not the bottleneck) serves every path;
the same request shapes (a distinct ~24-token text prompt per request, greedy,
``--max-tokens`` new tokens, streamed) go through:

1. ``router``: a ``ClusterRouter`` consumer inside the kvrelay server process,
   on its embedded router + worker, no HTTP (started by bench-only routes; the
   time is taken inside); TTFT is submit to the first delta that yields text
   (or the outcome): the moment the ingress could send its first chunk.
2. ``kvrelay-http``: the same server's API (``kvrelay serve``'s app on uvicorn,
   a subprocess) over loopback; TTFT is request sent to the first SSE chunk.
3. ``sglang-router``: PyPI ``sglang-router`` (Rust), round robin, in front of
   that kvrelay server as its only worker URL (kvrelay workers do not speak
   SGLang's HTTP worker protocol; the kvrelay server answers its OpenAI routes).
4. ``proxy``: a plain uvicorn + httpx pass-through ASGI proxy in front of it.

All paths share one server, model and worker, and are measured interleaved.
Figures: TTFT p50 at 1 stream (sequential) and p50/p99 at 64 concurrent
streams (bursts of 64), per path; the added latency of kvrelay's HTTP layer
(``kvrelay-http`` minus ``router``) next to the added latency of one
sglang-router hop (``sglang-router`` minus ``kvrelay-http``) and of the Python
proxy hop; and per path the highest Poisson request rate of a 1.5x ramp whose
p99 TTFT stays within twice that path's unloaded p99 (1-stream run); a path's
ramp stops after two failing steps in a row.

sglang-router is looked for with ``--sglang-router`` (default: on PATH, else
``/tmp/sgr-venv/bin/sglang-router``; install it apart with ``python3 -m venv
/tmp/sgr-venv && /tmp/sgr-venv/bin/pip install sglang-router``); without it
that baseline is left out and said so.

Run: ``.venv/bin/python bench/api.py --json bench-api.json`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvrelay.bench.report import Figure, report
from kvrelay.testing.ports import free_port

WORDS = (
    "paris",
    "rome",
    "cache",
    "page",
    "router",
    "worker",
    "token",
    "prefix",
    "chunk",
    "decode",
    "prefill",
    "quick",
    "brown",
    "fox",
    "lazy",
    "dog",
    "hello",
    "world",
    "attention",
    "state",
    "fixed",
    "size",
)
POOL = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=2.0)
"""Idle connections expire before uvicorn's 5 s keep-alive, so no request races a server-side close."""
Ttft = Callable[[int], Awaitable[float]]
"""One request by index; returns its TTFT in seconds."""


def prompt(index: int) -> str:
    """A distinct prompt per request, under one chunk (64 tokens), so no request reuses another's cache."""
    rng = random.Random(index)
    return f"{index} " + " ".join(rng.choice(WORDS) for _ in range(12))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --- the paths -----------------------------------------------------------------------------


def router_ttft(parts: Any, max_tokens: int) -> Ttft:
    """Requests straight to the embedded ``ClusterRouter`` of ``parts``, shaped exactly as the ingress shapes them."""
    from kvrelay.api.detokenize import IncrementalText
    from kvrelay.api.schema import CompletionRequest
    from kvrelay.core.router.events import Outcome, Request
    from kvrelay.router.cluster_router import Consumer

    async def one(index: int) -> float:
        body = CompletionRequest(model=parts.served.name, prompt=prompt(index), max_tokens=max_tokens, temperature=0.0)
        p = parts.ingress.prepare_completion(body)
        done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        detok = IncrementalText(p.model.tokenizer)
        first: list[float] = []

        def on_delta(_: int, tokens: tuple[int, ...]) -> None:
            if not first and detok.push(tokens):
                first.append(time.perf_counter())

        def on_result(outcome: Outcome) -> None:
            first.append(time.perf_counter())
            done.set_result(outcome)

        started = time.perf_counter()
        parts.router.submit(
            Request(f"bench-{index}-{started}", p.model.name, tuple(p.prompt), p.max_tokens, p.sampling),
            Consumer(on_delta, on_result),
        )
        outcome = await done
        if outcome.error:
            raise RuntimeError(f"request {index} failed: {outcome.error}")
        return first[0] - started

    return one


async def open_loop(one: Ttft, rate: float, step_s: float, first_index: int) -> tuple[list[float], int]:
    """Poisson arrivals at ``rate`` for ``step_s`` seconds (seeded by ``first_index``): TTFTs and failures."""
    rng = random.Random(first_index)
    tasks, at, index, started = [], 0.0, first_index, time.perf_counter()
    while at < step_s:
        delay = started + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index)))
        index += 1
        at += rng.expovariate(rate)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    ok = [r for r in results if isinstance(r, float)]
    return ok, len(results) - len(ok)


# --- subprocesses ---------------------------------------------------------------------------


async def serve_kvrelay(model_dir: Path, max_tokens: int, lanes: int, port: int, db_url: str) -> None:
    """The app of ``kvrelay serve`` on uvicorn (access log off, as sglang-router logs warnings only), plus two
    bench-only routes that run the ``router`` path in this same process: ``/bench/router`` (a list of request
    indices, all at once) and ``/bench/router_rate`` (an open-loop step); both answer the TTFTs measured inside."""
    import uvicorn

    from kvrelay.launch.serve import ServeOptions, embedded
    from kvrelay.launch.worker_assembly import WorkerSettings

    worker = WorkerSettings(
        "local-0", model=str(model_dir), dtype="float32", kv_tokens=32768, lanes=lanes, token_budget=2048
    )
    options = ServeOptions(port=port, db_url=db_url, worker=worker)
    async with embedded(options) as parts:
        app = parts.app
        one = router_ttft(parts, max_tokens)

        @app.post("/bench/router")
        async def bench_router(body: dict[str, Any]) -> dict[str, Any]:
            return {"ttft": await asyncio.gather(*(one(i) for i in body["indices"]))}

        @app.post("/bench/router_rate")
        async def bench_router_rate(body: dict[str, Any]) -> dict[str, Any]:
            ok, failed = await open_loop(one, body["rate"], body["step_s"], body["first_index"])
            return {"ttft": ok, "failed": failed}

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        await uvicorn.Server(config).serve()


def proxy_app(upstream: str) -> Callable[..., Awaitable[None]]:
    """A plain ASGI pass-through: method, path, headers and body forwarded; the response streamed back."""
    client = httpx.AsyncClient(base_url=upstream, timeout=None, limits=POOL)
    hop = {b"host", b"content-length", b"transfer-encoding", b"connection"}

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        target = scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        request = client.build_request(
            scope["method"], target, content=body, headers=[(k, v) for k, v in scope["headers"] if k.lower() not in hop]
        )
        response = await client.send(request, stream=True)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in hop],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    return app


@contextlib.contextmanager
def child(argv: list[str], name: str) -> Any:
    """A subprocess for the duration of the block, its output in a log file (named in errors)."""
    log = Path(tempfile.mkdtemp(prefix="bench-api-")) / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc, str(log)
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def until_ready(url: str, model: str, proc: subprocess.Popen[bytes], log: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                r = await client.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
                if r.status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} was not ready within {limit_s:.0f} s; see {log}")


# --- load shapes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """One path's three load shapes: one request, a burst of requests at once, an open-loop rate step."""

    name: str
    one: Ttft
    burst: Callable[[list[int]], Awaitable[list[float]]]
    step: Callable[[float, float, int], Awaitable[tuple[list[float], int]]]


def http_route(name: str, base_url: str, model: str, max_tokens: int, client: httpx.AsyncClient) -> Route:
    """Streaming completions over HTTP; TTFT is the request sent to the first SSE chunk."""

    async def one(index: int) -> float:
        body = {"model": model, "prompt": prompt(index), "max_tokens": max_tokens, "temperature": 0, "stream": True}
        started = time.perf_counter()
        ttft = None
        async with client.stream("POST", base_url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{base_url}: HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - started
        if ttft is None:
            raise RuntimeError(f"{base_url}: a stream without chunks")
        return ttft

    async def burst(indices: list[int]) -> list[float]:
        return list(await asyncio.gather(*(one(i) for i in indices)))

    async def step(rate: float, step_s: float, first_index: int) -> tuple[list[float], int]:
        return await open_loop(one, rate, step_s, first_index)

    return Route(name, one, burst, step)


def router_route(base_url: str, client: httpx.AsyncClient) -> Route:
    """The ``router`` path, run inside the kvrelay server process through its bench-only routes."""

    async def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await client.post(base_url + path, json=body)
        response.raise_for_status()
        return dict(response.json())

    async def one(index: int) -> float:
        return float((await call("/bench/router", {"indices": [index]}))["ttft"][0])

    async def burst(indices: list[int]) -> list[float]:
        return list((await call("/bench/router", {"indices": indices}))["ttft"])

    async def step(rate: float, step_s: float, first_index: int) -> tuple[list[float], int]:
        out = await call("/bench/router_rate", {"rate": rate, "step_s": step_s, "first_index": first_index})
        return list(out["ttft"]), int(out["failed"])

    return Route("router", one, burst, step)


@dataclass
class PathResult:
    c1: list[float]
    burst: list[float]
    max_rate: float = 0.0
    ramp: list[tuple[float, float]] | None = None


async def measure(routes: list[Route], args: argparse.Namespace) -> dict[str, PathResult]:
    """Every load shape on every route, interleaved (route after route, step after step), so drifting background
    load on the machine falls on every path alike. A route's ramp stops after two failing steps in a row."""
    results = {r.name: PathResult([], [], 0.0, []) for r in routes}
    next_index = 0

    def take(n: int) -> int:
        nonlocal next_index
        next_index += n
        return next_index - n

    for _ in range(args.warmup):
        for r in routes:
            await r.one(take(1))
    for _ in range(args.sequential):
        for r in routes:
            results[r.name].c1.append(await r.one(take(1)))
    for _ in range(args.bursts):
        for r in routes:
            first = take(args.concurrency)
            results[r.name].burst += await r.burst(list(range(first, first + args.concurrency)))
    limit = {r.name: 2 * pct(results[r.name].c1, 0.99) for r in routes}
    failing = {r.name: 0 for r in routes}
    rate = args.start_rate
    while rate <= args.max_rate and any(n < 2 for n in failing.values()):
        for r in routes:
            if failing[r.name] >= 2:
                continue
            ok, failed = await r.step(rate, args.step_s, take(int(4 * rate * args.step_s) + 100))
            p99 = pct(ok, 0.99) if ok else float("inf")
            res = results[r.name]
            assert res.ramp is not None
            res.ramp.append((rate, p99))
            if failed or p99 > limit[r.name]:
                failing[r.name] += 1
            else:
                failing[r.name] = 0
                res.max_rate = rate
        print(
            f"ramp {rate:.3g} req/s: "
            + ", ".join(
                f"{name} p99 {results[name].ramp[-1][1] * 1000:.3g} ms"
                for name in results  # type: ignore[index]
                if results[name].ramp and results[name].ramp[-1][0] == rate
            ),
            flush=True,
        )
        rate *= 1.5
    return results


async def run_bench(args: argparse.Namespace) -> list[Figure]:
    from kvrelay.testing.tiny_models import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-api-"))
    model_dir = make_tiny_model("gemma3", work / "tiny-gemma3")
    model = model_dir.name
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_argv = [
        sys.executable,
        __file__,
        "--serve-kvrelay",
        str(port),
        "--model-dir",
        str(model_dir),
        "--max-tokens",
        str(args.max_tokens),
        "--lanes",
        str(args.lanes),
        "--db-url",
        f"sqlite:///{work}/facts.sqlite3",
    ]
    sglang = args.sglang_router or shutil.which("sglang-router") or "/tmp/sgr-venv/bin/sglang-router"
    fronts = {
        "sglang-router": [
            sglang,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--worker-urls",
            base,
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
        ],
        "proxy": [sys.executable, __file__, "--serve-proxy", "{port}", "--upstream", base],
    }
    if not Path(sglang).exists():
        print(f"sglang-router not found at {sglang}: that baseline is left out", flush=True)
        del fronts["sglang-router"]
    try:
        async with httpx.AsyncClient(timeout=120, limits=POOL) as client, contextlib.AsyncExitStack() as stack:
            proc, log = stack.enter_context(child(server_argv, "kvrelay"))
            await until_ready(base, model, proc, log)
            routes = [router_route(base, client), http_route("kvrelay-http", base, model, args.max_tokens, client)]
            for name, argv in fronts.items():
                port = free_port()
                front, front_log = stack.enter_context(child([a.replace("{port}", str(port)) for a in argv], name))
                await until_ready(f"http://127.0.0.1:{port}", model, front, front_log)
                routes.append(http_route(name, f"http://127.0.0.1:{port}", model, args.max_tokens, client))
            results = await measure(routes, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures(results, args)


def figures(results: dict[str, PathResult], args: argparse.Namespace) -> list[Figure]:
    ms = 1000.0
    p50_1 = {k: statistics.median(r.c1) * ms for k, r in results.items()}
    p50_c = {k: statistics.median(r.burst) * ms for k, r in results.items()}
    c = f"c{args.concurrency}"
    print(
        f"\n{'path':<14} {'ttft p50 c1':>12} {'p99 c1':>9} {'p50 ' + c:>9} {'p99 ' + c:>9} {'max rate':>9}  ramp "
        "(req/s: p99 ms)"
    )
    for k, r in results.items():
        ramp = ", ".join(f"{rate:.3g}: {p99 * ms:.3g}" for rate, p99 in r.ramp or [])
        print(
            f"{k:<14} {p50_1[k]:>12.3f} {pct(r.c1, 0.99) * ms:>9.3f} {p50_c[k]:>9.3f} "
            f"{pct(r.burst, 0.99) * ms:>9.3f} {r.max_rate:>9.3g}  {ramp}"
        )
    http = results["kvrelay-http"]
    out = [Figure(f"{k}_ttft_p50_c1_ms", p50_1[k], "ms") for k in results]
    out += [Figure(f"{k}_ttft_p50_c{args.concurrency}_ms", p50_c[k], "ms") for k in results]
    added_1 = p50_1["kvrelay-http"] - p50_1["router"]
    added_c = p50_c["kvrelay-http"] - p50_c["router"]
    for hop in ("sglang-router", "proxy"):
        if hop not in results:
            continue
        suffix = "" if hop == "sglang-router" else "_vs_proxy"
        label = "sglang-router hop" if hop == "sglang-router" else "uvicorn pass-through proxy hop"
        out += [
            Figure(
                f"http_added_ttft_p50_c1_ms{suffix}",
                added_1,
                "ms",
                f"{label} (added TTFT p50, c1)",
                p50_1[hop] - p50_1["kvrelay-http"],
            ),
            Figure(
                f"http_added_ttft_p50_c{args.concurrency}_ms{suffix}",
                added_c,
                "ms",
                f"{label} (added TTFT p50, c{args.concurrency})",
                p50_c[hop] - p50_c["kvrelay-http"],
            ),
            Figure(
                f"http_max_rate_p99x2_rps{suffix}",
                http.max_rate,
                "req/s",
                f"{hop} in front of kvrelay-http (max rate)",
                results[hop].max_rate,
            ),
        ]
    out.append(
        Figure(
            "http_max_rate_p99x2_rps_vs_router",
            http.max_rate,
            "req/s",
            "in-process router, no HTTP (max rate)",
            results["router"].max_rate,
        )
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few requests, short ramp")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (default 16)")
    parser.add_argument("--lanes", type=int, default=64, help="worker lanes (default 64: every burst runs at once)")
    parser.add_argument("--concurrency", type=int, default=64, help="streams per burst (default 64)")
    parser.add_argument("--sequential", type=int, default=60, help="one-at-a-time requests (default 60)")
    parser.add_argument("--bursts", type=int, default=4, help="bursts of --concurrency streams (default 4)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--start-rate", type=float, default=4.0, help="first ramp rate, req/s (default 4)")
    parser.add_argument("--max-rate", type=float, default=400.0, help="last ramp rate tried, req/s (default 400)")
    parser.add_argument("--step-s", type=float, default=4.0, help="seconds per ramp step (default 4)")
    parser.add_argument("--sglang-router", default=None, help="path of the sglang-router executable")
    parser.add_argument("--json", default=None, help="write the figures as JSON to this path")
    parser.add_argument("--serve-kvrelay", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-proxy", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--db-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_kvrelay is not None:
        asyncio.run(serve_kvrelay(Path(args.model_dir), args.max_tokens, args.lanes, args.serve_kvrelay, args.db_url))
        return 0
    if args.serve_proxy is not None:
        import uvicorn

        uvicorn.run(
            proxy_app(args.upstream), host="127.0.0.1", port=args.serve_proxy, log_level="warning", access_log=False
        )
        return 0
    if args.quick:
        args.sequential, args.bursts, args.warmup, args.step_s, args.max_rate = 10, 1, 2, 1.0, 40.0
        args.concurrency = min(args.concurrency, 16)
        args.max_tokens = min(args.max_tokens, 4)
    figs = asyncio.run(run_bench(args))
    report(
        f"HTTP layer added latency (tiny gemma3, {args.max_tokens} new tokens, c1 and c{args.concurrency})",
        figs,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
