"""A vLLM engine driven from kvrelay's own process: vLLM's ``AsyncLLM`` in place of its OpenAI server.

Contract:
- ``InProcessEngine.start(model_dir, served_name, engine_argv, env)`` builds ``AsyncLLM`` from the engine
  arguments of a ``VllmServerSpec`` (``spec.engine_argv()``: the same model, dtype, block size, prefix caching, KV
  cache size, lanes, context and KV event publisher the spec's server would run, parsed by vLLM's own argument
  parser) in the spec's environment (threads, the model in the engine core's process). vLLM starts its engine core
  as a child process and talks to it over ZMQ; the API server, its HTTP hop, its OpenAI formatting and the SSE
  parsing on kvrelay's side are gone. It answers what ``client.EngineClient`` answers, so ``host.VllmWorker``
  drives either:
  - ``served_model()``: the served name, the model directory and ``max_model_len``; ``version()``: vLLM's;
  - ``figures()``: the scheduler's last figures (running and waiting requests, KV usage, prefix cache hits and
    queries) and the prefill totals of finished requests, which ``FiguresLogger`` (a vLLM stat logger) collects
    as vLLM's Prometheus logger would export them (``metrics.parse_metrics``); the block count and size from
    the engine's cache config;
  - ``stream(...)``: ``AsyncLLM.generate`` with a token-id prompt, vLLM's detokenizer off, outputs as deltas;
    the same ``StreamEvent`` s as the HTTP client (the tokens of each output, then one final event with the finish
    reason and the prompt tokens served from the prefix cache). Closing the generator early aborts the request
    (``AsyncLLM.generate`` does on cancellation and on close).
- Any failure of the engine (its core died, a request it refused) raises ``client.EngineError`` naming the
  engine (``url``: ``in-process://DIR``).
- An engine whose engine core died (``AsyncLLM.errored``) is built again in a thread, off the event loop, with
  the same arguments (``EngineBuild``): ``figures()`` raises ``EngineError`` meanwhile, so its worker reports
  the engine gone (a new epoch, no free pages) and then back; its KV events restart on the same port, which
  the worker's subscriber reads as a restarted publisher (another epoch).
- ``close()`` shuts the engine core down.

vLLM is imported when an engine starts: only vLLM's venv has it (``make vllm`` installs kvrelay there too), so
the rest of kvrelay never depends on it. This is what Dynamo's vLLM backend does (``components/src/dynamo/
vllm``: the worker builds ``AsyncLLM`` and serves token ids); the peer routers (SGLang Model Gateway,
vllm-router) front vLLM's OpenAI server instead, one process hop more (docs/performance.md, "vLLM's engine in
the router's process").
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvrelay.engines.vllm.client import EngineError, ServedModel, StreamEvent, request_body
from kvrelay.engines.vllm.metrics import EngineFigures
from kvrelay.engines.vllm.speeds import EngineTotals
from kvrelay.protocol.messages import FinishReason, Sampling

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 5.0
"""Seconds before a dead engine whose rebuild failed is built again."""
_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.CANCELLED}


@dataclass(slots=True)
class EngineTally:
    """What a ``FiguresLogger`` has seen, as the figures ``/metrics`` would give: the scheduler's last counts and
    KV usage, prefix-cache hits and queries summed, and the prefill totals of finished requests; the block count
    and size are the engine's cache config's."""

    figures: EngineFigures

    def record(self, scheduler: Any, iteration: Any) -> None:
        """One ``StatLoggerBase.record`` call's ``SchedulerStats`` and ``IterationStats`` (either may be None)."""
        now = self.figures
        if scheduler is not None:
            now = replace(
                now,
                running=scheduler.num_running_reqs,
                waiting=scheduler.num_waiting_reqs,
                kv_usage=scheduler.kv_cache_usage,
                prefix_hits=now.prefix_hits + scheduler.prefix_cache_stats.hits,
                prefix_queries=now.prefix_queries + scheduler.prefix_cache_stats.queries,
            )
        for done in iteration.finished_requests if iteration is not None else ():
            computed = done.num_prompt_tokens - max(done.num_cached_tokens, 0)
            t = now.totals
            totals = EngineTotals(
                t.prefill_requests + 1, t.prefill_seconds + done.prefill_time, t.prefill_tokens + computed
            )
            now = replace(now, totals=totals)
        self.figures = now


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids")
"""The fields of ``client.request_body`` that are ``SamplingParams`` keywords too."""


def request_params(max_tokens: int, sampling: Sampling, seed: int) -> dict[str, Any]:
    """``SamplingParams`` keywords of one attempt: what ``client.request_body`` asks the OpenAI server for, with
    vLLM's detokenizer off (outputs as deltas, ``RequestOutputKind.DELTA``, given by the caller)."""
    body = request_body("", (), max_tokens, sampling, seed)
    return {**{name: body[name] for name in SAMPLING_FIELDS}, "detokenize": False}


@dataclass(frozen=True, slots=True)
class EngineBuild:
    """How to build one engine: vLLM's engine arguments (``VllmServerSpec.engine_argv``) and the environment its
    engine core starts in. Calling it builds the engine (blocking: vLLM loads the model and starts its engine
    core) and returns it with the tally its stat logger feeds."""

    model_dir: str
    served_name: str
    engine_argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    def __call__(self) -> tuple[Any, EngineTally]:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.utils.argparse_utils import FlexibleArgumentParser
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.metrics.loggers import StatLoggerBase
        except ImportError as exc:
            raise EngineError(
                f"an in-process vLLM engine needs vLLM in this interpreter ({exc}); run kvrelay from vLLM's venv: "
                f"`make vllm`, then .venv-vllm/bin/kvrelay router ..."
            ) from None
        tally = EngineTally(EngineFigures())

        class FiguresLogger(StatLoggerBase):
            """Hands every record to ``tally`` (vLLM makes one per engine)."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                tally.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        args = AsyncEngineArgs.from_cli_args(parser.parse_args([*self.engine_argv, "--disable-log-stats"]))
        os.environ.update(self.env)  # the engine core is a child: it starts in this environment
        try:
            llm = AsyncLLM.from_engine_args(args, stat_loggers=[FiguresLogger])
        except Exception as exc:
            raise EngineError(f"the in-process vLLM engine of {self.model_dir} did not start: {exc!r}") from None
        cache = llm.vllm_config.cache_config
        tally.figures = replace(tally.figures, num_blocks=int(cache.num_gpu_blocks or 0), block_size=cache.block_size)
        return llm, tally


def is_vllm_process(pid: int) -> bool:
    """Whether ``pid`` runs now and names itself a vLLM process (its command line starts with ``VLLM::``, as
    vLLM's engine core sets it)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::")
    except OSError:
        return False


def engine_core_pids() -> set[int]:
    """This process's children that are vLLM engine cores (``is_vllm_process``)."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        found.update(int(pid) for pid in children if is_vllm_process(int(pid)))
    return found


class InProcessEngine:
    """One vLLM ``AsyncLLM`` in this process (see the module contract)."""

    def __init__(self, build: EngineBuild, on_cores: Callable[[list[int]], None] = lambda pids: None) -> None:
        """``on_cores`` is told the pids of the engine core processes each build starts (they must not outlive
        this process: ``launch.orphan_reaper``)."""
        self._build = build
        self._on_cores = on_cores
        self._llm, self._tally = self._built()
        self.url = f"in-process://{build.model_dir}"
        self._requests = 0
        self._restart: asyncio.Task[None] | None = None
        self.restarts = 0
        """Engines built again after their engine core died."""

    @classmethod
    def start(
        cls,
        model_dir: str,
        served_name: str,
        engine_argv: Sequence[str],
        env: Mapping[str, str],
        on_cores: Callable[[list[int]], None] = lambda pids: None,
    ) -> InProcessEngine:
        """Build the engine of ``engine_argv`` in ``env`` (``EngineBuild``)."""
        return cls(EngineBuild(model_dir, served_name, tuple(engine_argv), tuple(env.items())), on_cores)

    def _built(self) -> tuple[Any, EngineTally]:
        before = engine_core_pids()
        built = self._build()
        self._on_cores(sorted(engine_core_pids() - before))
        return built

    async def close(self) -> None:
        if self._restart is not None:
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
        self._llm.shutdown()

    async def served_model(self) -> ServedModel:
        build = self._build
        return ServedModel(build.served_name, build.model_dir, int(self._llm.model_config.max_model_len))

    async def version(self) -> str:
        import vllm

        return str(vllm.__version__)

    async def figures(self) -> EngineFigures:
        """The engine's figures; ``EngineError`` while its engine core is dead, whose first call starts building
        the engine again off the event loop (a failed build is tried again ``RESTART_BACKOFF_S`` later)."""
        if self._llm.errored:
            if self._restart is None:
                self._restart = asyncio.get_running_loop().create_task(self._rebuild())
            raise EngineError(f"vLLM engine at {self.url} died ({self._llm.dead_error!r}); building it again")
        return self._tally.figures

    async def _rebuild(self) -> None:
        self._llm.shutdown()
        try:
            self._llm, self._tally = await asyncio.to_thread(self._built)
            self.restarts += 1
            log.warning("in-process vLLM engine %s: built again after its engine core died", self.url)
        except EngineError as exc:
            log.warning("in-process vLLM engine %s: %s; trying again in %.0f s", self.url, exc, RESTART_BACKOFF_S)
            await asyncio.sleep(RESTART_BACKOFF_S)
        finally:
            self._restart = None

    async def stream(
        self, model: str, prompt: tuple[int, ...], max_tokens: int, sampling: Sampling, seed: int
    ) -> AsyncIterator[StreamEvent]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**request_params(max_tokens, sampling, seed), output_kind=RequestOutputKind.DELTA)
        self._requests += 1
        request_id = f"kvrelay-{self._requests}"
        finish: FinishReason | None = None
        cached = 0
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(prompt)), params, request_id):
                completion = out.outputs[0]
                if completion.finish_reason is not None:
                    finish = _FINISH.get(completion.finish_reason, FinishReason.ERROR)
                    cached = int(out.num_cached_tokens or 0)
                if completion.token_ids:
                    yield StreamEvent(tuple(completion.token_ids))
        except (GeneratorExit, KeyboardInterrupt):
            raise
        except Exception as exc:  # vLLM's refusals and a dead engine core alike
            raise EngineError(f"the vLLM engine at {self.url} failed the request ({exc!r})") from None
        if finish is None:
            raise EngineError(f"the vLLM engine at {self.url} ended the request without a finish reason")
        yield StreamEvent((), finish, cached)
