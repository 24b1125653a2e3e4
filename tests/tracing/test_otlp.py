"""End to end: spans sent over OTLP/HTTP to a receiver started here on localhost,
decoded with opentelemetry-proto, equal the spans the SDK produced; an unreachable
collector costs one warning and nothing else."""

from __future__ import annotations

import gzip
import logging
import socket
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sglite.engine import Engine
from tracing import setup_tracing
from tracing.otel import otlp_exporter


class Receiver(BaseHTTPRequestHandler):
    requests: list[ExportTraceServiceRequest] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        enc = self.headers.get("Content-Encoding", "")
        if enc == "gzip":
            body = gzip.decompress(body)
        elif enc == "deflate":
            body = zlib.decompress(body)
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        Receiver.requests.append(msg)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def _attr_value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_attr_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def test_otlp_http_receiver_gets_the_same_spans():
    Receiver.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = Engine("tiny-random", max_total_tokens=1024)
        mem = InMemorySpanExporter()
        http = otlp_exporter(f"127.0.0.1:{server.server_address[1]}", protocol="http/protobuf")
        tr = setup_tracing(engine.event_bus, 2, exporters=[mem, http], model="tiny-random")
        engine.generate(input_ids=[[3, 4, 5, 6], [3, 4, 7, 8, 9]], sampling_params={"max_new_tokens": 3, "temperature": 0})
        tr.shutdown()
    finally:
        server.shutdown()
    sent = {s.context.span_id: s for s in mem.get_finished_spans()}
    got = {}
    for req in Receiver.requests:
        for rs in req.resource_spans:
            service = {a.key: _attr_value(a.value) for a in rs.resource.attributes}["service.name"]
            assert service == "sglite"
            for ss in rs.scope_spans:
                for span in ss.spans:
                    got[int.from_bytes(span.span_id, "big")] = span
    assert set(got) == set(sent) and len(got) > 10
    for sid, ours in sent.items():
        theirs = got[sid]
        assert theirs.name == ours.name
        assert int.from_bytes(theirs.trace_id, "big") == ours.context.trace_id
        parent = int.from_bytes(theirs.parent_span_id, "big") if theirs.parent_span_id else None
        assert parent == (ours.parent.span_id if ours.parent else None)
        attrs = {a.key: _attr_value(a.value) for a in theirs.attributes}
        assert attrs == {k: (list(v) if isinstance(v, tuple) else v) for k, v in ours.attributes.items()}
        assert theirs.start_time_unix_nano == ours.start_time and theirs.end_time_unix_nano == ours.end_time


def test_unreachable_collector_warns_once_and_drops(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    engine = Engine("tiny-random", max_total_tokens=1024)
    exporter = otlp_exporter(f"127.0.0.1:{port}", protocol="http/protobuf", timeout=0.5)
    tr = setup_tracing(engine.event_bus, 1, exporters=[exporter])
    with caplog.at_level(logging.WARNING):
        outs = [engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 3, "temperature": 0})
                for _ in range(3)]
        tr.shutdown()
    assert all(len(o["output_ids"]) == 3 for o in outs)
    warnings = [r for r in caplog.records if "cannot export spans" in r.getMessage()]
    assert len(warnings) == 1
    assert exporter.dropped > 0


def test_otlp_grpc_receiver_gets_the_spans():
    """The default protocol (SGLang's --otlp-traces-endpoint localhost:4317) over gRPC."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []

    class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802
            received.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        engine = Engine("tiny-random", max_total_tokens=1024)
        mem = InMemorySpanExporter()
        tr = setup_tracing(engine.event_bus, 2, exporters=[mem, otlp_exporter(f"127.0.0.1:{port}", protocol="grpc")])
        engine.generate(input_ids=[3, 4, 5, 6], sampling_params={"max_new_tokens": 3, "temperature": 0}, rid="g")
        tr.shutdown()
    finally:
        server.stop(0)
    names = sorted(span.name for req in received for rs in req.resource_spans for ss in rs.scope_spans
                   for span in ss.spans)
    assert names == sorted(s.name for s in mem.get_finished_spans())
    assert "req g" in names and "forward" in names
