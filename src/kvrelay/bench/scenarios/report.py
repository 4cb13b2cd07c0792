"""The scenarios' results as figures (JSON) and a Markdown report.

``figures(summaries)`` returns the list every kvrelay benchmark writes: one
``{"name", "value", "unit", "baseline", "baseline_value"}`` per measured
quantity, named ``<case>_<quantity>``; latency, token, byte, page and eviction
figures compare against the same quantity of the ``cold`` case of the same
run, a case's checks against what a correct run gives (none lost, none
leaked, every survivor complete). Missing quantities (no samples) are left out.
``markdown(...)`` renders the tables and links the plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrelay.bench.scenarios.stats import CaseSummary

BASELINE = "cold"

CHECKS: dict[str, tuple[str, str]] = {
    "errors": ("requests", "none"),
    "requests_with_whole_prefix_on_gpu": ("requests", "requests"),
    "continued_requests": ("requests", "none"),
    "flood_requests": ("requests", "requests"),
    "fresh_worker_start_s": ("s", "none"),
    "cancelled_streams": ("requests", "cancels asked"),
    "survivors": ("requests", "requests"),
    "survivors_completed": ("requests", "survivors"),
    "survivors_identical_to_resident": ("requests", "survivors"),
    "leaked_pages": ("pages", "none"),
    "quiesce_s": ("s", "none"),
    "streams_in_flight_at_kill": ("requests", "requests"),
    "completed": ("requests", "requests"),
    "lost": ("requests", "none"),
    "identical_to_resident": ("requests", "requests"),
    "worker_restart_s": ("s", "fresh_worker_start_s"),
    "kill_at_s": ("s", "none"),
}
"""Per check: its unit and what it is compared with."""


def _quantities(s: CaseSummary) -> dict[str, tuple[float | None, str]]:
    q: dict[str, tuple[float | None, str]] = {}
    for k, v in s.ttft_s.items():
        q[f"ttft_{k}"] = (v, "s")
    for k, v in s.router_ttft_s.items():
        q[f"router_ttft_{k}"] = (v, "s")
    for k, v in s.runtime_ttft_s.items():
        q[f"runtime_ttft_{k}"] = (v, "s")
    for k, v in s.itl_s.items():
        q[f"itl_{k}"] = (v, "s")
    q["recomputed_tokens"] = (s.recomputed_tokens, "tokens")
    q["pages_used_peak"] = (s.pages_used_peak, "pages")
    q["pages_active_peak"] = (s.pages_active_peak, "pages")
    q["restore_s"] = (s.restore_s, "s")
    q["restore_overlap_fraction"] = (s.restore_overlap_fraction, "fraction")
    for tier, n in s.cached_tokens.items():
        q[f"cached_tokens_{tier}"] = (n, "tokens")
    for tier, n in s.restored_bytes.items():
        q[f"restored_bytes_{tier}"] = (n, "bytes")
    for tier, n in s.held_bytes.items():
        q[f"held_bytes_{tier}"] = (n, "bytes")
    for reason, n in s.evictions.items():
        q[f"evictions_{reason.replace(':', '_')}"] = (n, "evictions")
    return q


def _check_baseline(name: str, s: CaseSummary, by_name: dict[str, CaseSummary]) -> tuple[str, float]:
    _, against = CHECKS.get(name, ("", "none"))
    if against == "requests":
        return "requests in the case", s.requests
    if against == "survivors":
        return "survivors", s.checks.get("survivors", s.requests)
    if against == "cancels asked":
        return "cancels asked", -(-s.requests // 3)
    if against == "fresh_worker_start_s" and "object" in by_name:
        return "object_fresh_worker_start_s", by_name["object"].checks.get("fresh_worker_start_s", 0.0)
    return "expected", 0.0


def figures(summaries: Sequence[CaseSummary]) -> list[dict[str, Any]]:
    by_name = {s.name: s for s in summaries}
    base = _quantities(by_name[BASELINE]) if BASELINE in by_name else {}
    out: list[dict[str, Any]] = []
    for s in summaries:
        for key, (value, unit) in _quantities(s).items():
            if value is None:
                continue
            base_value = base.get(key, (0, unit))[0]
            out.append(
                {
                    "name": f"{s.name}_{key}",
                    "value": value,
                    "unit": unit,
                    "baseline": f"{BASELINE}_{key}",
                    "baseline_value": base_value if base_value is not None else 0,
                }
            )
        for key, value in s.checks.items():
            baseline, base_value = _check_baseline(key, s, by_name)
            out.append(
                {
                    "name": f"{s.name}_{key}",
                    "value": value,
                    "unit": CHECKS.get(key, ("count", ""))[0],
                    "baseline": baseline,
                    "baseline_value": base_value,
                }
            )
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _tiers(d: dict[str, int], scale: float = 1.0, unit: str = "") -> str:
    parts = [f"{k} {v / scale:.1f}{unit}" if scale != 1.0 else f"{k} {v}" for k, v in sorted(d.items()) if v]
    return ", ".join(parts) or "-"


def case_table(summaries: Sequence[CaseSummary]) -> list[str]:
    lines = [
        (
            "| case | n | TTFT p50 / p90 / p99 (ms) | at router p50 / p90 (ms) | in runtime p50 / p90 (ms) "
            "| ITL p50 / p99 (ms) | peak pages used / active / total | cached tokens by tier "
            "| recomputed tokens | restored MB by tier | held MB by tier | evictions "
            "| restore s (overlapped with decode) |"
        ),
        "| --- | ---: | --- | --- | --- | --- | --- | --- | ---: | --- | --- | --- | --- |",
    ]
    for s in summaries:
        overlap = s.restore_overlap_fraction
        restore = "-" if not s.restore_s else f"{s.restore_s:.2f} ({overlap:.0%})" if overlap is not None else "-"
        lines.append(
            f"| {s.name} | {s.requests} | {_ms(s.ttft_s['p50'])} / {_ms(s.ttft_s['p90'])} / {_ms(s.ttft_s['p99'])} "
            f"| {_ms(s.router_ttft_s['p50'])} / {_ms(s.router_ttft_s['p90'])} "
            f"| {_ms(s.runtime_ttft_s['p50'])} / {_ms(s.runtime_ttft_s['p90'])} "
            f"| {_ms(s.itl_s['p50'])} / {_ms(s.itl_s['p99'])} "
            f"| {s.pages_used_peak} / {s.pages_active_peak} / {s.pages_total} | {_tiers(s.cached_tokens)} "
            f"| {s.recomputed_tokens} | {_tiers(s.restored_bytes, 1e6)} | {_tiers(s.held_bytes, 1e6)} "
            f"| {_tiers(s.evictions)} | {restore} |"
        )
    return lines


def markdown(
    summaries: Sequence[CaseSummary], header: dict[str, str], plots: dict[str, str], figure_list: list[dict[str, Any]]
) -> str:
    """The report: how it was made, the case table, each case's checks, the plots."""
    lines = ["# kvrelay bench scenarios", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "## Cases", ""]
    lines += [
        f"- **{s.name}**: {s.description}; finish reasons {_tiers(s.finish_reasons)}; accepted offers by "
        f"worker {_tiers(s.chosen_workers)}"
        for s in summaries
    ]
    lines += ["", "## Per case", ""] + case_table(summaries)
    lines += [
        "",
        (
            'TTFT is measured by the client (request sent to first streamed text); "at router" from the '
            "request's arrival at the router to its first token there (the fact store's measured outcome: "
            'the difference to the client\'s TTFT is HTTP, ingress validation and streaming); "in runtime" '
            "from the job's submission to the worker's runtime to its first token (its queue and prefill), "
            "measured in the workers; between the two lie routing, the offer, admission and restore. "
            "Cached and recomputed tokens come from the router's measured outcomes (fact store); restored "
            "bytes, evictions and restore/decode overlap from each worker's probe; held bytes are the ram and "
            "ssd tiers of the live workers and the whole S3 bucket at the end of the case. Evictions count "
            "from the start of the case's setup (e.g. the flood before `ssd`): `gpu:durable` / `gpu:lru` are "
            "page-pool evictions by reason, `ram:capacity` / `ssd:capacity` chunk-tier evictions."
        ),
        "",
        "## Checks",
        "",
        "| figure | value | compared with | baseline value |",
        "| --- | ---: | --- | ---: |",
    ]
    checks = {f"{s.name}_{k}" for s in summaries for k in s.checks}
    for f in figure_list:
        if f["name"] in checks:
            value = f["value"]
            shown = f"{value:.2f}" if isinstance(value, float) and not float(value).is_integer() else f"{value:g}"
            lines.append(f"| {f['name']} | {shown} | {f['baseline']} | {f['baseline_value']:g} |")
    lines += ["", "## Plots", ""] + [f"![{title}]({path})" for title, path in plots.items()]
    return "\n".join(lines) + "\n"
