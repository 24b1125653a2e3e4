"""Timeline nodes -> OpenTelemetry spans, and the exporters (OTLP gRPC/HTTP to Jaeger
or a collector, console, JSON lines). Export runs on the SDK's batch thread, never on
the scheduler's; a collector that cannot be reached costs one warning."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter, SpanExportResult)
from opentelemetry.trace import Link, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tracing.timeline import Listener, Node

logger = logging.getLogger("sglite.tracing")
_OTLP_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                 "opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk.trace.export")


class SpanListener(Listener):
    def __init__(self, tracer: trace.Tracer):
        self.tracer = tracer
        # events carry time.monotonic(); spans want epoch nanoseconds
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def on_open(self, node: Node) -> None:
        if node.parent is not None:
            ctx = trace.set_span_in_context(node.parent.handle)
        elif node.remote_parent:  # the HTTP request's span in the server's main process (or the client's)
            ctx = TraceContextTextMapPropagator().extract({"traceparent": node.remote_parent})
        else:
            ctx = Context()
        links = [Link(n.handle.get_span_context()) for n in node.links if n.handle is not None]
        node.handle = self.tracer.start_span(node.name, context=ctx, start_time=self._ns(node.start), links=links,
                                             attributes=dict(node.attributes))

    def on_close(self, node: Node) -> None:
        span = node.handle
        span.set_attributes(node.attributes)
        for name, ts, attrs in node.events:
            span.add_event(name, attributes=attrs, timestamp=self._ns(ts))
        if node.error:
            span.set_status(Status(StatusCode.ERROR, node.error))
        span.end(end_time=self._ns(node.end if node.end is not None else node.start))


class JsonlSpanExporter(SpanExporter):
    """One finished span per line, as the SDK's JSON."""

    def __init__(self, path: str):
        self._f = open(path, "w")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for s in spans:
            self._f.write(s.to_json(indent=None) + "\n")
        self._f.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._f.close()


class WarnOnceExporter(SpanExporter):
    """Wraps a network exporter: failures drop the batch and log one warning in all."""

    def __init__(self, inner: SpanExporter, where: str):
        self.inner = inner
        self.where = where
        self.warned = False
        self.dropped = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - any transport error means the same: drop
            result = SpanExportResult.FAILURE
        if result != SpanExportResult.SUCCESS:
            self.dropped += len(spans)
            if not self.warned:
                self.warned = True
                logger.warning("sglite tracing: cannot export spans to %s; dropping them (tracing continues)", self.where)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class HttpSpans:
    """``sglite serve``'s SERVER span per generation request: a child of the client's W3C
    ``traceparent`` (when it sent one), and the parent whose traceparent the request
    carries to the scheduler process."""

    def __init__(self, tracer: trace.Tracer):
        self.tracer = tracer
        self.propagator = TraceContextTextMapPropagator()

    def start(self, method: str, path: str, headers: dict[str, str]) -> tuple[str, Callable[[int | None, str], None]]:
        """The traceparent to hand on, and ``end(status_code, error)`` for the span."""
        span = self.tracer.start_span(f"{method} {path}", context=self.propagator.extract(headers),
                                      kind=trace.SpanKind.SERVER,
                                      attributes={"http.request.method": method, "url.path": path})
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))

        def end(status_code: int | None, error: str = "") -> None:
            if status_code is not None:
                span.set_attribute("http.response.status_code", status_code)
            if error:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()

        return carrier.get("traceparent", ""), end


def otlp_exporter(endpoint: str, protocol: str | None = None, timeout: float = 2.0) -> SpanExporter:
    """``endpoint`` like SGLang's ``--otlp-traces-endpoint localhost:4317``. The protocol
    comes from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, or http/protobuf on :4318)."""
    protocol = protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    for name in _OTLP_LOGGERS:  # their retries would log every failed batch; we warn once
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = endpoint if endpoint.startswith("http") else f"http://{endpoint}"
        if not url.rstrip("/").endswith("/v1/traces"):
            url = url.rstrip("/") + "/v1/traces"
        inner: SpanExporter = HttpExporter(endpoint=url, timeout=timeout)
        where = url
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        inner = GrpcExporter(endpoint=endpoint, insecure=True, timeout=timeout)
        where = f"grpc://{endpoint}"
    return WarnOnceExporter(inner, where)


def make_provider(exporters: Sequence[SpanExporter], batch: bool = True, service_name: str = "sglite") -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    for exp in exporters:
        if batch:
            provider.add_span_processor(BatchSpanProcessor(exp, max_queue_size=8192, schedule_delay_millis=500))
        else:
            provider.add_span_processor(SimpleSpanProcessor(exp))
    return provider


__all__ = ["ConsoleSpanExporter", "HttpSpans", "JsonlSpanExporter", "SpanListener", "WarnOnceExporter", "make_provider",
           "otlp_exporter"]
