"""The tracing package's part of the ``sglite`` command (found through the
``sglite.cli_plugins`` entry point, so the engine's CLI does not import it)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tracing (OpenTelemetry)")
    g.add_argument("--trace-level", type=int, default=None, choices=(0, 1, 2, 3),
                   help="0 off, 1 request stages, 2 + scheduler iterations and forwards, 3 + per-token events "
                        "(default: 2 when an exporter is given, else 0)")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="send spans over OTLP to a collector or Jaeger, e.g. localhost:4317 (gRPC); set "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for HTTP on :4318")
    g.add_argument("--trace-jsonl", default=None, metavar="PATH", help="write finished spans as JSON lines")
    g.add_argument("--trace-console", action="store_true", help="print finished spans to stdout")


def check_args(args: argparse.Namespace) -> None:
    """Before anything loads: the span file's folder exists."""
    from sglite.cli import check_output_path

    check_output_path(getattr(args, "trace_jsonl", None), "--trace-jsonl")


def _level(args: argparse.Namespace) -> tuple[int, bool]:
    """The trace level the options ask for, and whether they name an exporter."""
    wants = bool(args.otlp_traces_endpoint or args.trace_jsonl or args.trace_console)
    return (args.trace_level if args.trace_level is not None else (2 if wants else 0)), wants


def attach(bus: Any, args: argparse.Namespace, model: str) -> Callable[[], None] | None:
    from tracing import setup_tracing

    level, wants = _level(args)
    if level and not wants:
        print("warning: --trace-level given without an exporter (--otlp-traces-endpoint, --trace-jsonl, "
              "--trace-console); spans go nowhere", file=sys.stderr)
    tr = setup_tracing(bus, level, otlp_endpoint=args.otlp_traces_endpoint, jsonl_path=args.trace_jsonl,
                       console=args.trace_console, model=model)
    return tr.shutdown if tr is not None else None


def attach_http(args: argparse.Namespace, model: str) -> tuple[Any, Callable[[], None]] | None:
    """``sglite serve``'s main process: HttpSpans, one SERVER span per HTTP request (the
    parent of the request's spans in the scheduler process), exported where the
    scheduler's spans go; None when tracing is off."""
    level, wants = _level(args)
    if not level or not wants:
        return None
    from tracing import make_exporters
    from tracing.otel import HttpSpans, make_provider

    # the scheduler writes its spans to --trace-jsonl itself: the server's go beside it
    jsonl = f"{args.trace_jsonl}.http" if args.trace_jsonl else None
    provider = make_provider(make_exporters(args.otlp_traces_endpoint, jsonl, args.trace_console))

    def close() -> None:
        provider.force_flush(timeout_millis=5000)
        provider.shutdown()

    return HttpSpans(provider.get_tracer("sglite.http")), close


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="work with recordings: convert to a Perfetto / Chrome timeline")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    conv = tsub.add_parser("convert", help="convert an event recording (--record) to another format")
    conv.add_argument("recording", help="JSON lines written by --record")
    conv.add_argument("--to", choices=("perfetto",), default="perfetto",
                      help="perfetto: Chrome trace-event JSON for ui.perfetto.dev or chrome://tracing")
    conv.add_argument("out", help="output file")
    conv.add_argument("--trace-level", type=int, default=3, choices=(1, 2, 3))
    conv.set_defaults(func=_convert)


def _convert(args: argparse.Namespace) -> int:
    from sglite.events import load_events
    from tracing.perfetto import write_chrome_trace

    if not os.path.isfile(args.recording):
        print(f"error: {args.recording}: no such file", file=sys.stderr)
        return 1
    try:
        events = list(load_events(args.recording))
        n = write_chrome_trace(events, args.out, args.trace_level) if events else 0
    except (ValueError, KeyError, TypeError) as e:
        print(f"error: {args.recording}: not an sglite event recording ({e})", file=sys.stderr)
        return 1
    if not events:
        print(f"error: {args.recording}: no events in it (record one with --record)", file=sys.stderr)
        return 1
    print(f"wrote {n} trace events to {args.out} (open it in https://ui.perfetto.dev)")
    return 0
