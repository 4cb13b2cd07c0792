"""The figures a kvrelay worker reads from a vLLM server's Prometheus ``/metrics`` (pure).

Names as vLLM 0.32 exports them (``vllm/v1/metrics/loggers.py``):
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (a fraction, 0 to 1, of the device blocks in use;
cached blocks no request holds count as free), ``vllm:cache_config_info``
(labels ``num_gpu_blocks``, ``block_size`` and ``prefix_cache_retention_interval``: every
``CacheConfig`` field is a label), ``vllm:prefix_cache_hits_total``
and ``vllm:prefix_cache_queries_total``, and the sums and counts of the
histograms ``engines.vllm.speeds`` learns from (``vllm:request_prefill_time_seconds``,
``vllm:request_prefill_kv_computed_tokens``).
Counts of every engine index are summed; the KV usage is the highest of them.
(An aborted request is counted nowhere: ``vllm:request_success_total`` counts
only requests that finished.) ``NAMES`` are the sample names read, and
``parse_metrics`` hands only their lines to the Prometheus parser: the whole
exposition of vLLM 0.32 is about 54 kB, which took the parser 16-22 ms a poll on
the 2-core machine (0.6 ms now, ``bench/vllm_path.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvrelay.engines.vllm.speeds import EngineTotals


@dataclass(frozen=True, slots=True)
class EngineFigures:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    block_size: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    totals: EngineTotals = EngineTotals()
    checkpoint_tokens: int | None = None
    """Tokens between the prefix-cache checkpoints vLLM keeps of sliding-window layers
    (``prefix_cache_retention_interval``; ``None`` there, dense, reads as the block size): 0, only at a
    prompt's end and where two cached prompts part; ``None``, not exported (an older vLLM)."""

    @property
    def used_blocks(self) -> int:
        """Device blocks requests hold now (rounded up)."""
        return min(self.num_blocks, -int(-self.kv_usage * self.num_blocks // 1))


class MetricsError(ValueError):
    """An exposition that lacks what a kvrelay worker needs from vLLM."""


def parse_metrics(text: str) -> EngineFigures:
    """The figures of one ``/metrics`` exposition; ``MetricsError`` if it has no vLLM cache config."""
    values: dict[str, float] = {}
    num_blocks = block_size = 0
    retention: str | None = None
    try:
        families = list(text_string_to_metric_families(_lines_of_names(text)))
    except ValueError as exc:
        raise MetricsError(f"not a Prometheus exposition: {exc}") from None
    for family in families:
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                num_blocks += _int_label(sample.labels, "num_gpu_blocks")
                block_size = block_size or _int_label(sample.labels, "block_size")
                retention = sample.labels.get("prefix_cache_retention_interval", retention)
            elif name == "vllm:kv_cache_usage_perc":
                values[name] = max(values.get(name, 0.0), sample.value)
            elif name in _SUMMED:
                values[name] = values.get(name, 0.0) + sample.value
    if not num_blocks or not block_size:
        raise MetricsError("no vllm:cache_config_info with num_gpu_blocks and block_size: is this a vLLM server?")
    return EngineFigures(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
        num_blocks=num_blocks,
        block_size=block_size,
        prefix_hits=int(values.get("vllm:prefix_cache_hits_total", 0)),
        prefix_queries=int(values.get("vllm:prefix_cache_queries_total", 0)),
        totals=EngineTotals(
            prefill_requests=values.get("vllm:request_prefill_time_seconds_count", 0.0),
            prefill_seconds=values.get("vllm:request_prefill_time_seconds_sum", 0.0),
            prefill_tokens=values.get("vllm:request_prefill_kv_computed_tokens_sum", 0.0),
        ),
        checkpoint_tokens=_checkpoint_tokens(retention, block_size),
    )


_SUMMED = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_prefill_kv_computed_tokens_sum",
    }
)
NAMES = ("vllm:cache_config_info", "vllm:kv_cache_usage_perc", *sorted(_SUMMED))
"""Every sample name ``parse_metrics`` reads."""


_NAME_SET = frozenset(NAMES)


def _lines_of_names(text: str) -> str:
    """The sample lines of ``text`` whose metric name is one of ``NAMES`` (comments left out)."""
    kept = []
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        if line[:end] in _NAME_SET:
            kept.append(line)
    return "\n".join(kept) + "\n"


def _checkpoint_tokens(retention: str | None, block_size: int) -> int | None:
    """``EngineFigures.checkpoint_tokens`` of the label's text (``None``: no label, or one that is no count)."""
    if retention == "None":
        return block_size
    return int(retention) if retention is not None and retention.isdigit() else None


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return int(labels.get(name, "0"))
    except ValueError:
        return 0
