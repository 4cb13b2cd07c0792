"""One model served by one paged runtime: artifacts + model + KV pages + page pool + device loop.

``Engine.open(source, dtype, ...)`` loads the artifacts (``None``: the default
Gemma 3 270M) and hands them to ``Engine.from_artifacts``, the one place that
builds the paged model, allocates ``KVPages`` big enough for ``kv_tokens``
tokens, makes the page pool and starts a ``PagedRuntime`` (a served worker,
``launch.worker_assembly.build_worker``, is built on it too). ``engine.generate(prompt_ids,
...)`` is the one-call path used by ``kvrelay generate`` and the bench: it takes
pages from the pool, runs the job, and returns the pages when the job has
finished (quiesced). The pool is guarded by a lock so several threads may call
``generate`` at once. ``close()`` stops the runtime; the engine is a context manager.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvrelay.core.planning.predicted_ttft import pages_needed as pages_for
from kvrelay.models.dtypes import DTYPE_NAMES
from kvrelay.protocol.chunk_keys import DEFAULT_CHUNK_TOKENS, DEFAULT_PAGE_TOKENS
from kvrelay.protocol.messages import Sampling
from kvrelay.worker.page_pool import PagePool
from kvrelay.worker.runtime.iteration import PolicyConfig
from kvrelay.worker.runtime.jobs import EventCallback, Job, JobResult
from kvrelay.worker.runtime.loop import PagedRuntime, StepModel
from kvrelay.worker.runtime.torch_threads import confine_threads

if TYPE_CHECKING:
    from kvrelay.models.loading.loader import LoadedArtifacts

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""Each dtype name of ``DTYPE_NAMES`` as its torch dtype (``"bfloat16"``: ``torch.bfloat16``)."""


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` or ``"bfloat16"`` as a torch dtype; a clear error otherwise."""
    if name not in DTYPES:
        raise ValueError(f"dtype '{name}' is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Sizes of one engine: KV capacity in tokens (rounded up to whole pages), page size, lanes, tokens per
    forward (``prefill_only_budget`` in a forward with no decoding lane, 0: ``token_budget``), queue bound,
    device, and the page pool's chunk size (``None``: the most whole pages within ``DEFAULT_CHUNK_TOKENS``, at
    least one)."""

    kv_tokens: int = 16_384
    page_tokens: int = DEFAULT_PAGE_TOKENS
    num_lanes: int = 32
    token_budget: int = 512
    queue_capacity: int = 64
    device: str = "cpu"
    chunk_tokens: int | None = None
    prefill_only_budget: int = 0

    @property
    def pool_chunk_tokens(self) -> int:
        """The page pool's chunk size (see the class docstring)."""
        if self.chunk_tokens is not None:
            return self.chunk_tokens
        return self.page_tokens * max(1, DEFAULT_CHUNK_TOKENS // self.page_tokens)


class Engine:
    """A loaded model with its page pool and device loop (see the module docstring)."""

    def __init__(self, artifacts: LoadedArtifacts, model: StepModel, runtime: PagedRuntime, pool: PagePool) -> None:
        self.artifacts = artifacts
        self.model = model
        self.runtime = runtime
        self.pool = pool
        self._pool_lock = threading.Lock()

    @classmethod
    def open(cls, source: str | Path | None, dtype: str = "float32", options: EngineOptions | None = None) -> Engine:
        """Load ``source`` (a model directory, a GGUF file, or None for the default model) and start serving."""
        from kvrelay.models.loading.loader import load_artifacts

        torch_dtype = parse_dtype(dtype)
        confine_threads()  # before loading: the device thread alone runs torch ops in parallel
        artifacts = load_artifacts(None if source is None else Path(source), dtype=torch_dtype)
        return cls.from_artifacts(artifacts, torch_dtype, options or EngineOptions())

    @classmethod
    def from_artifacts(cls, artifacts: LoadedArtifacts, dtype: torch.dtype, options: EngineOptions) -> Engine:
        """Serve already loaded ``artifacts`` (lets a bench share one load between engines)."""
        from kvrelay.models.kernels.kv_pages import KVPages
        from kvrelay.models.registry import build_model

        model = build_model(artifacts.config, artifacts.weights, dtype, options.device)
        num_pages = pages_for(options.kv_tokens, options.page_tokens)
        kv = KVPages.allocate(artifacts.config, num_pages, options.page_tokens, dtype, options.device)
        policy = PolicyConfig(options.num_lanes, options.token_budget, options.prefill_only_budget)
        runtime = PagedRuntime(model, kv, policy, options.queue_capacity)
        return cls(artifacts, model, runtime, PagePool(num_pages, options.page_tokens, options.pool_chunk_tokens))

    @property
    def page_tokens(self) -> int:
        return self.runtime.kv.page_tokens

    def allocate_pages(self, num_tokens: int) -> list[int]:
        """Pages for ``num_tokens`` tokens (``PoolExhaustedError`` if the pool is short)."""
        with self._pool_lock:
            return self.pool.allocate(pages_for(num_tokens, self.page_tokens))

    def free_pages(self, pages: list[int]) -> None:
        with self._pool_lock:
            self.pool.free(pages)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        on_event: EventCallback | None = None,
        timeout: float | None = None,
    ) -> JobResult:
        """Prefill ``prompt_ids`` on fresh pages, sample up to ``max_new_tokens``, free the pages.

        On timeout or interruption the job is cancelled; its pages are freed only once it has
        quiesced (if it does not within 30 s they stay allocated rather than be reused while written).
        """
        sampling = sampling or Sampling(stop_token_ids=tuple(self.artifacts.config.eos_token_ids))
        pages = self.allocate_pages(len(prompt_ids) + max_new_tokens)
        job = Job(tuple(prompt_ids), tuple(pages), max_new_tokens=max_new_tokens, sampling=sampling)
        handle = None
        try:
            handle = self.runtime.submit(job, on_event)
            try:
                return handle.result(timeout)
            except BaseException:
                handle.cancel()
                handle.result(30.0)
                raise
        finally:
            if handle is None or handle.done:
                self.free_pages(pages)

    def close(self) -> None:
        self.runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
