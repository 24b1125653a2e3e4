"""Events -> Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and
chrome://tracing open: one track per request, one for the scheduler's iterations (two
in the overlap loop, whose batches overlap in time), one for forwards. Built on the
same timeline as the OpenTelemetry spans."""

from __future__ import annotations

import json
from typing import Any, Iterable

from sglite.events import Event
from tracing.timeline import TRACE_LEVEL_TOKENS, Listener, Node, TimelineBuilder

PID_SCHEDULER, PID_REQUESTS = 1, 2
TRACK_NAMES = {"scheduler": "iterations", "forward": "forward"}


class _Collect(Listener):
    def __init__(self) -> None:
        self.closed: list[Node] = []

    def on_close(self, node: Node) -> None:
        self.closed.append(node)


def _jsonable(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.items()}


class _Lanes:
    """Slices on one thread track must nest. Spans that overlap without nesting (the
    overlap loop's consecutive batches, a request's next chunk admitted before the
    last one's result came back) go to an extra lane of their track: "iterations (2)"."""

    def __init__(self, out: list[dict[str, Any]]):
        self.out = out
        self.stacks: dict[str, list[list[float]]] = {}  # track -> per lane, the open slices' ends
        self.tids: dict[tuple[str, int], tuple[int, int]] = {}
        self.lane_of: dict[int, int] = {}  # node id -> its lane
        self.next_tid = {PID_SCHEDULER: 1, PID_REQUESTS: 1}

    def place(self, node: Node, start: float, end: float) -> tuple[int, int]:
        stacks = self.stacks.setdefault(node.track, [])
        order = list(range(len(stacks)))
        parent = node.parent
        if parent is not None and parent.track == node.track and parent.id in self.lane_of:
            order.remove(self.lane_of[parent.id])
            order.insert(0, self.lane_of[parent.id])  # with its parent when it fits
        lane = next((i for i in order if self._fits(stacks[i], start, end)), None)
        if lane is None:
            lane = len(stacks)
            stacks.append([])
        stacks[lane].append(end)
        self.lane_of[node.id] = lane
        return self._tid(node.track, lane)

    @staticmethod
    def _fits(stack: list[float], start: float, end: float) -> bool:
        while stack and stack[-1] <= start + 1e-3:
            stack.pop()
        return not stack or end <= stack[-1] + 1e-3

    def _tid(self, track: str, lane: int) -> tuple[int, int]:
        if (track, lane) not in self.tids:
            pid = PID_REQUESTS if track.startswith("req ") else PID_SCHEDULER
            tid = self.next_tid[pid]
            self.next_tid[pid] += 1
            name = TRACK_NAMES.get(track, track) + (f" ({lane + 1})" if lane else "")
            self.out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}})
            self.tids[(track, lane)] = (pid, tid)
        return self.tids[(track, lane)]


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

    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID_SCHEDULER, "tid": 0, "ts": 0, "args": {"name": "sglite scheduler"}},
        {"ph": "M", "name": "process_name", "pid": PID_REQUESTS, "tid": 0, "ts": 0, "args": {"name": "requests"}},
    ]
    lanes = _Lanes(out)
    # parents before children at equal start, so viewers nest them
    depth = {}
    for node in collect.closed:
        d, p = 0, node.parent
        while p is not None:
            d, p = d + 1, p.parent
        depth[node.id] = d
    for node in sorted(collect.closed, key=lambda n: (n.start, depth[n.id])):
        end = node.end if node.end is not None else node.start
        ts, dur = us(node.start), round(max(0.0, (end - node.start) * 1e6), 3)
        pid, tid = lanes.place(node, ts, ts + dur)
        args = _jsonable(node.attributes)
        if node.error:
            args["error"] = node.error
        out.append({"ph": "X", "name": node.name, "cat": node.kind, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                    "args": args})
        for name, t, attrs in node.events:
            out.append({"ph": "i", "s": "t", "name": name, "cat": "event", "pid": pid, "tid": tid, "ts": us(t),
                        "args": _jsonable(attrs)})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"source": "sglite"}}


def write_chrome_trace(events: Iterable[Event], path: str, level: int = TRACE_LEVEL_TOKENS) -> int:
    trace = events_to_chrome_trace(events, level)
    with open(path, "w") as f:
        json.dump(trace, f)
    return len(trace["traceEvents"])
