"""Tracing for sglite: engine events -> OpenTelemetry spans (Jaeger, console, JSONL)
and Chrome/Perfetto timelines. The engine never imports this package; it subscribes to
the engine's EventBus."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sglite.events import EventBus
from tracing.timeline import TRACE_LEVEL_ITERATIONS, TRACE_LEVEL_REQUESTS, TRACE_LEVEL_TOKENS, TimelineBuilder

__all__ = ["TRACE_LEVEL_ITERATIONS", "TRACE_LEVEL_REQUESTS", "TRACE_LEVEL_TOKENS", "Tracing", "setup_tracing"]


@dataclass
class Tracing:
    builder: TimelineBuilder
    provider: Any
    exporters: list[Any]
    _unsubscribe: Callable[[], None] = field(repr=False, default=lambda: None)

    def shutdown(self) -> None:
        """Close what is still open, flush and stop the exporters."""
        self._unsubscribe()
        self.builder.close_open(time.monotonic())
        self.provider.force_flush(timeout_millis=5000)
        self.provider.shutdown()


def make_exporters(otlp_endpoint: str | None, jsonl_path: str | None, console: bool) -> list[Any]:
    """The span exporters the tracing options name (OTLP, a JSON-lines file, stdout)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from tracing.otel import JsonlSpanExporter, otlp_exporter

    exps: list[Any] = []
    if otlp_endpoint:
        exps.append(otlp_exporter(otlp_endpoint))
    if jsonl_path:
        exps.append(JsonlSpanExporter(jsonl_path))
    if console:
        exps.append(ConsoleSpanExporter())
    return exps


def setup_tracing(bus: EventBus, level: int = TRACE_LEVEL_ITERATIONS, *, otlp_endpoint: str | None = None,
                  jsonl_path: str | None = None, console: bool = False, exporters: list[Any] | None = None,
                  batch: bool = True, model: str = "") -> Tracing | None:
    """Subscribe an OpenTelemetry span builder to ``bus``. Level 0 returns None."""
    if level <= 0:
        return None
    from tracing.otel import SpanListener, make_provider

    exps = list(exporters or []) + make_exporters(otlp_endpoint, jsonl_path, console)
    provider = make_provider(exps, batch=batch)
    builder = TimelineBuilder(SpanListener(provider.get_tracer("sglite")), level, model)
    return Tracing(builder, provider, exps, bus.subscribe(builder))
