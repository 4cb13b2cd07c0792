"""Tracing of a process face: on when the face is given ``--otlp-endpoint``, else off and never imported."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.telemetry.tracing import Tracing

log = logging.getLogger(__name__)


def start_tracing(endpoint: str | None, service: str, instance: str = "") -> Tracing | None:
    """Export this process's spans to the OTLP/HTTP collector at ``endpoint`` (None: no tracing, and the
    OpenTelemetry SDK is not even imported)."""
    if not endpoint:
        return None
    from kvrelay.telemetry.tracing import Tracing

    tracing = Tracing.to(endpoint, service, instance)
    log.info("%s: exporting request traces to %s", service, endpoint)
    return tracing
