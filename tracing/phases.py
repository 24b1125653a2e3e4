"""Where the scheduler's time went, from a run's events: per phase of each iteration
(plan = get_next_batch_to_run, launch = run_batch, wait = until the forward whose
results are next is done, process = process_batch_result), the forwards' own time, and
how much of the scheduler's work ran while a forward was running (hidden by overlap).

In the normal loop run_batch runs the forward inline, so "launch" is the forward and
nothing is hidden; in the overlap loop "launch" only queues it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from sglite import events as ev


@dataclass
class SchedulerTime:
    iterations: int = 0
    plan: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    process: float = 0.0
    forward: float = 0.0  # the forwards themselves, wherever they ran
    busy: float = 0.0  # the scheduler's own work: plan + process (+ launch when overlapped)
    hidden: float = 0.0  # the part of ``busy`` that ran while a forward was running

    @property
    def hidden_fraction(self) -> float:
        return self.hidden / self.busy if self.busy else 0.0


def _covered(spans: list[tuple[float, float]], covers: list[tuple[float, float]]) -> float:
    """Total length of ``spans`` lying inside ``covers`` (sorted, disjoint)."""
    total, j = 0.0, 0
    for s, e in sorted(spans):
        while j < len(covers) and covers[j][1] <= s:
            j += 1
        k = j
        while k < len(covers) and covers[k][0] < e:
            total += max(0.0, min(e, covers[k][1]) - max(s, covers[k][0]))
            k += 1
    return total


def scheduler_time(events: Iterable[ev.Event]) -> SchedulerTime:
    events = list(events)
    starts = {e.bid: e.ts for e in events if isinstance(e, ev.ForwardStarted)}
    forwards = sorted((starts[e.bid], e.ts) for e in events if isinstance(e, ev.ForwardFinished) and e.bid in starts)
    t = SchedulerTime(forward=sum(e - s for s, e in forwards))
    busy: list[tuple[float, float]] = []
    for it in events:
        if not isinstance(it, ev.IterationFinished) or not (it.bid or it.processed_bid):
            continue
        overlapped = it.processed_bid != it.bid
        t.iterations += 1
        t.plan += it.scheduled - it.started
        t.launch += it.forwarded - it.scheduled
        t.wait += it.resolved - it.forwarded
        t.process += it.ts - it.resolved
        busy += [(it.started, it.scheduled), (it.resolved, it.ts)]
        if overlapped:
            busy.append((it.scheduled, it.forwarded))
    t.busy = sum(e - s for s, e in busy)
    t.hidden = _covered(busy, forwards)
    return t
