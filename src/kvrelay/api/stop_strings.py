"""Stop strings on streamed text: what may be emitted now, and what must be held back."""

from __future__ import annotations


def cut_at_stop(emitted: str, held: str, stops: tuple[str, ...]) -> tuple[str, bool, str]:
    """Split ``held`` into (text safe to emit, whether a stop string was hit, text still held back)."""
    if not stops:
        return held, False, ""
    window = emitted[-max(len(s) for s in stops) :] + held
    offset = len(window) - len(held)
    for stop in stops:
        at = window.find(stop)
        if at != -1:
            return held[: max(0, at - offset)], True, ""
    keep = max(len(s) for s in stops) - 1
    for n in range(min(keep, len(held)), 0, -1):
        if any(s.startswith(held[-n:]) for s in stops):
            return held[:-n], False, held[-n:]
    return held, False, ""
