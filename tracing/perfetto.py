"""Events -> Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and
chrome://tracing open: one track per request, one for the scheduler's iterations,
one for forwards. Built on the same timeline as the OpenTelemetry spans."""

from __future__ import annotations

import json
from typing import Any, Iterable

from sglite.events import Event
from tracing.timeline import TRACE_LEVEL_TOKENS, Listener, Node, TimelineBuilder

PID_SCHEDULER, PID_REQUESTS = 1, 2
TID_ITERATIONS, TID_FORWARD = 1, 2


class _Collect(Listener):
    def __init__(self) -> None:
        self.closed: list[Node] = []

    def on_close(self, node: Node) -> None:
        self.closed.append(node)


def _jsonable(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.items()}


def events_to_chrome_trace(events: Iterable[Event], level: int = TRACE_LEVEL_TOKENS) -> dict[str, Any]:
    events = list(events)
    collect = _Collect()
    builder = TimelineBuilder(collect, level)
    for e in events:
        builder(e)
    if events:
        builder.close_open(events[-1].ts)
    t0 = min((n.start for n in collect.closed), default=0.0)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    req_tids: dict[str, int] = {}
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID_SCHEDULER, "tid": 0, "ts": 0, "args": {"name": "sglite scheduler"}},
        {"ph": "M", "name": "thread_name", "pid": PID_SCHEDULER, "tid": TID_ITERATIONS, "ts": 0, "args": {"name": "iterations"}},
        {"ph": "M", "name": "thread_name", "pid": PID_SCHEDULER, "tid": TID_FORWARD, "ts": 0, "args": {"name": "forward"}},
        {"ph": "M", "name": "process_name", "pid": PID_REQUESTS, "tid": 0, "ts": 0, "args": {"name": "requests"}},
    ]
    # parents before children at equal start, so viewers nest them
    depth = {}
    for node in collect.closed:
        d, p = 0, node.parent
        while p is not None:
            d, p = d + 1, p.parent
        depth[node.id] = d
    for node in sorted(collect.closed, key=lambda n: (n.start, depth[n.id])):
        if node.track.startswith("req "):
            pid = PID_REQUESTS
            tid = req_tids.get(node.track)
            if tid is None:
                tid = req_tids[node.track] = len(req_tids) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                            "args": {"name": node.track}})
        else:
            pid, tid = PID_SCHEDULER, TID_FORWARD if node.track == "forward" else TID_ITERATIONS
        args = _jsonable(node.attributes)
        if node.error:
            args["error"] = node.error
        end = node.end if node.end is not None else node.start
        out.append({"ph": "X", "name": node.name, "cat": node.kind, "pid": pid, "tid": tid, "ts": us(node.start),
                    "dur": round(max(0.0, (end - node.start) * 1e6), 3), "args": args})
        for name, ts, attrs in node.events:
            out.append({"ph": "i", "s": "t", "name": name, "cat": "event", "pid": pid, "tid": tid, "ts": us(ts),
                        "args": _jsonable(attrs)})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"source": "sglite"}}


def write_chrome_trace(events: Iterable[Event], path: str, level: int = TRACE_LEVEL_TOKENS) -> int:
    trace = events_to_chrome_trace(events, level)
    with open(path, "w") as f:
        json.dump(trace, f)
    return len(trace["traceEvents"])
