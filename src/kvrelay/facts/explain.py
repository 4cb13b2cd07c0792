"""Why the router sent a request where it did, as text (what ``kvrelay explain`` prints).

``explain_lines(history)`` gives, per attempt and per recorded scoring: every
candidate (worker, route, cached tokens, predicted TTFT and its terms), the
winner, why each other candidate lost (a higher predicted TTFT, by how much and
in which terms, or a lost tie-break) and which workers a hard constraint
excluded, the offer's outcome, and the measured outcome with predicted against
measured TTFT. It is pure: the command (``kvrelay.cli.explain``) reads the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.facts.queries import DecisionRow, OutcomeRow, RequestHistory

SERVED = ("accepted", "worker_lost", "cancelled")
"""Offer outcomes after which the attempt ran on the chosen worker (its prediction is the one measured)."""

TERM_NAMES = (("queue_s", "queue"), ("restore_s", "restore"), ("prefill_s", "prefill"), ("decode_s", "decode"))


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def _signed_ms(seconds: float) -> str:
    return f"{seconds * 1000:+.1f} ms"


def format_route(route: list[list[Any]]) -> str:
    """``gpu x2 > ram x1 > recompute``: tier, chunk count and source (peer or bucket) per segment."""
    parts = []
    for segment in route:
        tier, chunks = segment[0], segment[1]
        source = f"@{segment[2]}" if len(segment) > 2 and segment[2] else ""
        parts.append(f"{tier}{source}" + (f" x{chunks}" if chunks else ""))
    return " > ".join(parts) if parts else "recompute all"


def _term_values(terms: dict[str, Any]) -> dict[str, float]:
    restore = terms.get("restore_s") or {}
    return {
        "queue_s": float(terms.get("queue_s", 0.0)),
        "restore_s": float(sum(restore.values())),
        "prefill_s": float(terms.get("prefill_s", 0.0)),
        "decode_s": float(terms.get("decode_s", 0.0)),
    }


def format_terms(terms: dict[str, Any]) -> str:
    """``queue 1.0 ms, restore 2.0 ms (ssd 2.0 ms), prefill 3.0 ms, decode 4.0 ms``."""
    values = _term_values(terms)
    restore = terms.get("restore_s") or {}
    by_tier = ", ".join(f"{tier} {_ms(s)}" for tier, s in sorted(restore.items()) if s)
    parts = []
    for key, label in TERM_NAMES:
        text = f"{label} {_ms(values[key])}"
        parts.append(f"{text} ({by_tier})" if key == "restore_s" and by_tier else text)
    return ", ".join(parts)


def _candidate_label(candidate: dict[str, Any]) -> str:
    return f"{candidate['worker_id']} [{format_route(candidate['route'])}]"


def why_lost(candidate: dict[str, Any], winner: dict[str, Any], policy: str) -> str:
    """Why ``candidate`` lost to ``winner``: the predicted TTFT gap and the terms that made it."""
    gap = candidate["predicted_ttft_s"] - winner["predicted_ttft_s"]
    if gap > 0:
        mine, theirs = _term_values(candidate["terms"]), _term_values(winner["terms"])
        diffs = [
            f"{label} {_signed_ms(mine[k] - theirs[k])}" for k, label in TERM_NAMES if abs(mine[k] - theirs[k]) >= 5e-8
        ]
        return f"predicted TTFT {_signed_ms(gap)} higher" + (f" ({', '.join(diffs)})" if diffs else "")
    if gap == 0:
        return "same predicted TTFT; lost the deterministic tie-break"
    if candidate.get("score_s", 0.0) > winner.get("score_s", 0.0) > 0.0:
        return (
            f"predicted TTFT {_ms(-gap)} lower, but its score was {_ms(candidate['score_s'] - winner['score_s'])}"
            " higher: it recomputes more on a busy cluster (the score adds weighted prefill seconds)"
        )
    return f"predicted TTFT {_ms(-gap)} lower, but policy {policy!r} chose by its own rule"


def _decision_lines(number: int, decision: DecisionRow) -> list[str]:
    lines = [
        f"  decision {number} at t={decision.time:.3f} (policy {decision.policy}, model {decision.model}): "
        f"{len(decision.candidates)} candidates, {len(decision.excluded)} excluded"
    ]
    winner = decision.chosen
    for candidate in sorted(decision.candidates, key=lambda c: c["predicted_ttft_s"]):
        mark = "*" if candidate == winner else "-"
        lines.append(
            f"    {mark} {_candidate_label(candidate)}: cached {candidate['cached_tokens']} tokens, "
            f"predicted TTFT {_ms(candidate['predicted_ttft_s'])} = {format_terms(candidate['terms'])}"
        )
    if winner is None:
        lines.append("    winner: none (no worker could take the request)")
    else:
        lines.append(f"    winner: {_candidate_label(winner)}, predicted TTFT {_ms(winner['predicted_ttft_s'])}")
        for candidate in decision.candidates:
            if candidate != winner:
                lines.append(f"    lost: {_candidate_label(candidate)}: {why_lost(candidate, winner, decision.policy)}")
    for worker_id, reason in sorted(decision.excluded.items()):
        lines.append(f"    excluded: {worker_id}: {reason}")
    lines.append("    offer: " + offer_text(decision))
    return lines


def offer_text(decision: DecisionRow) -> str:
    """What became of the decision's offer: none sent, no answer yet, or its outcome, by whom, why and when."""
    if decision.outcome == "unroutable":
        return "none sent"
    if decision.outcome == "offered":
        return f"sent to {decision.chosen_worker}; no answer recorded"
    when = f" at t={decision.outcome_time:.3f}" if decision.outcome_time is not None else ""
    reason = f" ({decision.outcome_reason})" if decision.outcome_reason else ""
    return f"{decision.outcome.replace('_', ' ')} by {decision.chosen_worker}{reason}{when}"


def _outcome_lines(outcome: OutcomeRow, decisions: list[DecisionRow]) -> list[str]:
    lines = [
        f"measured outcome (attempt {outcome.attempt}, {outcome.attempts} attempt(s) in all): "
        f"finish {outcome.finish_reason}"
    ]
    served = [d for d in decisions if d.attempt == outcome.attempt and d.outcome in SERVED]
    predicted = served[-1].predicted_ttft_s if served else None
    if outcome.ttft_s is not None and predicted is not None:
        gap = outcome.ttft_s - predicted
        share = f", {gap / predicted:+.0%}" if predicted > 0 else ""
        lines.append(f"  TTFT: measured {_ms(outcome.ttft_s)} vs predicted {_ms(predicted)} ({_signed_ms(gap)}{share})")
    else:
        lines.append(f"  TTFT: measured {_ms(outcome.ttft_s)}, predicted {_ms(predicted)}")
    if outcome.itl_count:
        lines.append(
            f"  inter-token latency over {outcome.itl_count} gaps: mean {_ms(outcome.itl_mean_s)}, "
            f"p50 {_ms(outcome.itl_p50_s)}, p99 {_ms(outcome.itl_p99_s)}, max {_ms(outcome.itl_max_s)}"
        )
    cached = ", ".join(f"{t} {n}" for t, n in sorted(outcome.cached_tokens.items())) or "none"
    moved = ", ".join(f"{t} {n} B" for t, n in sorted(outcome.bytes_by_tier.items())) or "none"
    lines.append(
        f"  tokens: cached by tier {cached}; recomputed {outcome.recomputed_tokens}; "
        f"generated {outcome.generated_tokens}"
    )
    lines.append(f"  bytes moved by tier: {moved}")
    if outcome.error:
        lines.append(f"  error: {outcome.error}")
    return lines


def explain_lines(history: RequestHistory) -> list[str]:
    """The explanation of one request, as printed lines."""
    attempts = sorted({d.attempt for d in history.decisions})
    lines = [f"request {history.request_id}: {len(attempts)} attempt(s), {len(history.decisions)} decision(s)"]
    for attempt in attempts:
        lines.append(f"attempt {attempt}")
        ours = [d for d in history.decisions if d.attempt == attempt]
        for number, decision in enumerate(ours, start=1):
            lines.extend(_decision_lines(number, decision))
    if history.outcome is None:
        lines.append("measured outcome: not recorded yet")
    else:
        lines.extend(_outcome_lines(history.outcome, history.decisions))
    return lines
