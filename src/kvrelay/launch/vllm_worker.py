"""One vLLM worker's parts: the engine client, the host, the ``/metrics`` poller and the KV event subscriber.

``build_vllm_worker(settings)`` waits (up to ``engine_wait_s``) until the
engine at ``engine_url`` answers, reads its served model (name, directory,
context limit), version and figures (block count and size), fingerprints the
model directory (``settings.model``, else the directory the engine reports
serving: the worker must see the same files), and returns the wired
``VllmParts``: the model's kvrelay name is its directory's name, as the
router's catalog names it. ``start()`` starts polling ``/metrics`` every
``poll_s`` and following the KV events at ``kv_events`` (none: the worker
routes without residency); ``aclose()`` stops both and closes the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvrelay import paths
from kvrelay.engines.vllm.admission import EngineIdentity
from kvrelay.engines.vllm.client import EngineClient, EngineError, VllmEngine
from kvrelay.engines.vllm.host import VllmWorker
from kvrelay.engines.vllm.identity import engine_fingerprint, kv_bytes_per_token
from kvrelay.engines.vllm.in_process import InProcessEngine
from kvrelay.engines.vllm.speeds import probe_fit, window_point
from kvrelay.engines.vllm.subscriber import follow_kv_events
from kvrelay.launch import defaults, orphan_reaper
from kvrelay.launch.vllm_server import VllmServerSpec, checkpoint_warning
from kvrelay.launch.worker_assembly import new_epoch
from kvrelay.models.config import ModelConfig
from kvrelay.protocol.messages import Sampling

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /metrics poll

PROBE_TOKENS = (32, 512)
"""Prompt lengths of the start-up probes: far enough apart to tell a step's fixed cost from the cost per token."""
PROBE_REPEATS = 3
"""Probes of each length; the quickest counts (``speeds.probe_fit``)."""


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """How to build one vLLM worker: its id, its engine's URLs, the model directory and the engine's dtype."""

    worker_id: str
    engine_url: str
    kv_events: str | None = None
    model: str | None = None
    """The directory the engine serves; None: the ``root`` the engine reports."""
    dtype: str = defaults.DTYPE
    """The dtype the engine runs (it counts in the fingerprint and the KV bytes per token)."""
    max_lanes: int = defaults.VLLM_LANES
    """Concurrent requests the engine runs at most (its ``--max-num-seqs``)."""
    poll_s: float = 1.0
    """Seconds between ``/metrics`` polls. vLLM 0.32 renders its whole exposition (about 54 kB) for each, which
    took its API server, the process that streams every token, about 5 ms of its event loop on the 2-core
    machine; the figures only bound admission (promised blocks cover the lag), show when the engine is gone,
    and feed the speed estimate, none of which needs more than a second's freshness."""
    engine_wait_s: float = 600.0
    probe: bool = True
    """Measure the engine's prefill speed at start (``probe_speeds``)."""
    in_process: VllmServerSpec | None = None
    """Run this engine in this process (``engines.vllm.in_process``) instead of reaching a server at
    ``engine_url``; its KV events come from the spec's port."""


@dataclass
class VllmParts:
    controller: VllmWorker
    client: VllmEngine
    settings: VllmSettings
    model_dir: Path
    """The directory the engine serves (``settings.model``, else the one it reports)."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.controller.me.model

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        host = self.controller
        self.tasks.append(loop.create_task(host.monitor(self.settings.poll_s)))
        if self.settings.kv_events:
            events = follow_kv_events(self.settings.kv_events, host.on_kv_frame, host.on_kv_reconnect)
            self.tasks.append(loop.create_task(events))

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.close()


async def build_vllm_worker(settings: VllmSettings) -> VllmParts:
    """Connect to the engine (or start it in this process) and wire the worker's parts (see the module
    docstring)."""
    client: VllmEngine
    if settings.in_process is not None:
        spec = settings.in_process  # blocks the loop while vLLM loads: before the router serves
        argv, env = spec.engine_argv(), spec.env({})
        client = InProcessEngine.start(spec.model, spec.served_name or spec.model, argv, env, orphan_reaper.watch)
    else:
        client = EngineClient(settings.engine_url)
    deadline = time.monotonic() + settings.engine_wait_s
    while True:
        try:
            served = await client.served_model()
            version = await client.version()
            figures = await client.figures()
            break
        except EngineError as exc:
            if time.monotonic() > deadline:
                await client.close()
                raise EngineError(f"{exc}; gave up after {settings.engine_wait_s:.0f} s") from None
            log.info("waiting for the vLLM engine at %s: %s", settings.engine_url, exc)
            await asyncio.sleep(1.0)
    model_dir = Path(settings.model or served.root).expanduser()
    warning = checkpoint_warning(model_dir, figures)
    if warning is not None:
        log.warning("vLLM worker %s: %s", settings.worker_id, warning)
    fingerprint = await asyncio.to_thread(
        engine_fingerprint, model_dir, version, settings.dtype, figures.block_size, paths.cache_dir() / "digests"
    )
    identity = EngineIdentity(
        settings.worker_id, new_epoch(), model_dir.name, fingerprint, served.context_limit, figures.block_size
    )
    host = VllmWorker(
        identity,
        client,
        served.name,
        kv_bytes_per_token(model_dir, settings.dtype),
        settings.max_lanes,
        figures,
    )
    if settings.probe:
        vocab = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text())).vocab_size
        await probe_speeds(host, served.name, vocab, served.context_limit)
    log.info(
        "vLLM worker %s: engine %s (vllm %s) serves %s as '%s'; %d blocks of %d tokens, context %d",
        settings.worker_id,
        settings.engine_url,
        version,
        model_dir,
        served.name,
        figures.num_blocks,
        figures.block_size,
        served.context_limit,
    )
    return VllmParts(host, client, settings, model_dir)


async def probe_speeds(host: VllmWorker, engine_model: str, vocab_size: int, context_limit: int) -> None:
    """One-token greedy completions of random prompts of ``PROBE_TOKENS`` tokens, each followed by a ``/metrics``
    read, so the worker's prefill fit starts from two points of this engine's own speed.

    Without them a fresh worker's fit held only what the engine had served before, which on a fresh engine is a
    health check's few tokens: their fixed cost read as a cost per token of milliseconds, 50 times the tiny test
    model's, and the router held or spread the first requests of a replay on that (predicted 1.7-4.3 s for
    0.05-0.9 s). The prompts are random token ids (no one else's prefix); a probe that fails is logged and
    skipped, as the fit then learns from the first requests. Each length is probed ``PROBE_REPEATS`` times and
    the fit starts from the quickest of each, without the engine's history: that history holds whatever load
    the engine served under before, and a single probe whatever the other engines' probes cost it at the
    same moment; either made one of two identical engines look ten times slower than the other, and the router
    then sent it almost nothing (docs/performance.md, "Served fits of alike prompts")."""
    rng = random.Random(host.epoch)
    low = min(1000, vocab_size // 2)
    samples: list[list[tuple[float, float]]] = []
    for length in PROBE_TOKENS:
        samples.append([])
        for _ in range(PROBE_REPEATS):
            prompt = tuple(rng.randrange(low, vocab_size) for _ in range(min(length, context_limit - 2)))
            before = host.figures.totals
            try:
                async for _ in host.engine.stream(engine_model, prompt, 1, Sampling(), 0):
                    pass
                host.on_figures(await host.engine.figures())
            except EngineError as exc:
                log.warning("vLLM worker %s: speed probe of %d tokens failed: %s", host.worker_id, len(prompt), exc)
                continue
            point = window_point(before, host.figures.totals)
            if point is not None:
                samples[-1].append(point)
    if any(samples):
        host.speeds = replace(host.speeds, engine=probe_fit(host.figures.totals, samples))
