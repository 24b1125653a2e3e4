"""Deterministic re-execution of a recording and the difference of two runs
(``sglite replay --rerun`` / ``--diff``; docs/why.md).

A recording (``--record``) starts with RecordingStarted (the engine's server arguments,
with the KV pool size and request limit it resolved) and holds every request's
ReqArrived: its token ids, its sampling parameters with the seed it drew from, and the
iteration it arrived in, and every client abort (ReqAborted by_client). ``rerun`` builds
the same engine (or one with overrides) and submits each request (and abort) just
before that iteration: a virtual clock counted in scheduler
iterations, not seconds. The scheduler decides from its state alone, so the same
arguments give the same batches, events and tokens; only timestamps and durations
differ, and ``first_difference`` ignores those (TIMING_FIELDS)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, NamedTuple

from sglite import events as ev

# fields that hold wall-clock readings: they differ between any two runs
TIMING_FIELDS = frozenset({"ts", "started", "scheduled", "forwarded", "resolved", "duration"})


class Recording(NamedTuple):
    server_args: dict[str, Any]
    events: list[ev.Event]
    arrivals: dict[int, list[ev.ReqArrived]]  # iteration -> the requests that arrived in it
    aborts: dict[int, list[ev.ReqAborted]]  # iteration -> the client aborts received in it


def header_for(engine: Any) -> ev.RecordingStarted:
    """What a recording of ``engine`` starts with: its server arguments, with the pool
    size and request limit it resolved (so a rerun does not size them again)."""
    from sglite import __version__

    args = dataclasses.asdict(engine.server_args)
    args["max_total_tokens"] = engine.scheduler.max_total_num_tokens
    args["max_running_requests"] = engine.scheduler.max_running_requests
    return ev.RecordingStarted(server_args=args, version=__version__)


def load(path: str) -> Recording:
    """Read a recording; ValueError (one line) when it cannot be rerun."""
    events = list(ev.load_events(path))
    header = next((e for e in events if isinstance(e, ev.RecordingStarted)), None)
    if header is None:
        raise ValueError(f"{path} has no RecordingStarted line: record it with --record (sglite >= 0.1 writes one)")
    arrivals: dict[int, list[ev.ReqArrived]] = defaultdict(list)
    for e in events:
        if isinstance(e, ev.ReqArrived):
            if not e.input_ids:
                raise ValueError(f"{path}: request {e.rid} was recorded without its token ids")
            arrivals[e.iteration].append(e)
    if not arrivals:
        raise ValueError(f"{path} holds no requests")
    aborts: dict[int, list[ev.ReqAborted]] = defaultdict(list)
    for e in events:
        if isinstance(e, ev.ReqAborted) and e.by_client:
            aborts[e.iteration].append(e)
    return Recording(dict(header.server_args), events, dict(arrivals), dict(aborts))


def rerun(rec: Recording, overrides: dict[str, Any] | None = None, out_path: str | None = None) -> list[ev.Event]:
    """Run the recording's requests again on a fresh engine, each submitted before the
    iteration it arrived in; returns the new run's events, RecordingStarted first (also
    written to ``out_path``, itself a recording)."""
    from sglite.engine import Engine
    from sglite.managers.io_struct import AbortReq

    engine = Engine(**{**rec.server_args, **(overrides or {})})
    header = header_for(engine)
    log = ev.EventLog()
    log(header)  # the events start as the recording does
    closers = [engine.event_bus.subscribe(log, snapshots=True)]
    if out_path:
        recorder = ev.EventRecorder(out_path, header)
        closers += [engine.event_bus.subscribe(recorder, snapshots=True), recorder.close]
    try:
        pending = sorted(set(rec.arrivals) | set(rec.aborts))
        while pending or engine.scheduler.has_work():
            upcoming = engine.scheduler.iteration + 1
            while pending and pending[0] <= upcoming:
                it = pending.pop(0)
                for a in rec.arrivals.get(it, ()):
                    # only a keyed request passes extra_key, so unkeyed recordings rerun
                    # on any Engine.submit, with or without that keyword
                    salt = {} if a.extra_key is None else {"extra_key": a.extra_key}
                    engine.submit(input_ids=list(a.input_ids), sampling_params=dict(a.sampling_params),
                                  rid=a.rid, **salt)
                for x in rec.aborts.get(it, ()):
                    engine.scheduler.send(AbortReq(x.rid, x.reason))
            engine.step()
    finally:
        engine.shutdown()
        for close in closers:
            close()
    return log.events


def comparable(events: list[ev.Event], start: int) -> list[dict[str, Any]]:
    """The events from iteration ``start`` on, without wall-clock fields."""
    return [{k: v for k, v in e.to_dict().items() if k not in TIMING_FIELDS}
            for e in events if e.iteration >= start and not isinstance(e, ev.RecordingStarted)]


def first_difference(a: list[ev.Event], b: list[ev.Event]) -> str | None:
    """None when two runs made the same events (timestamps aside) from the first
    request's arrival on; else where they part, in one line."""
    start = min(e.iteration for e in a if isinstance(e, ev.ReqArrived))
    xs, ys = comparable(a, start), comparable(b, start)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x != y:
            fields = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            shown = ", ".join(f"{k}: {x.get(k)!r} vs {y.get(k)!r}" for k in fields)[:400]
            return f"event {i} (iteration {x.get('iteration')}, {x.get('kind')} vs {y.get('kind')}): {shown}"
    if len(xs) != len(ys):
        return f"one run has {len(xs)} events, the other {len(ys)}: the first {min(len(xs), len(ys))} agree"
    return None


@dataclasses.dataclass
class RequestRun:
    """One request in one run, as --diff compares it (iterations are the virtual clock)."""

    arrived: int = 0
    arrived_ts: float = 0.0
    admitted: int | None = None  # its first admission
    first_token: int | None = None
    first_token_s: float | None = None  # seconds from arrival
    cached: int = 0  # prompt tokens the radix cache served, over its admissions
    retracts: int = 0
    chunks: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    finish: str = ""

    @property
    def wait(self) -> int | None:
        return None if self.admitted is None else self.admitted - self.arrived

    @property
    def ttft(self) -> int | None:
        return None if self.first_token is None else self.first_token - self.arrived


def summarize(events: list[ev.Event]) -> dict[str, RequestRun]:
    """Each request's RequestRun, from a run's events."""
    runs: dict[str, RequestRun] = {}
    for e in events:
        rid = getattr(e, "rid", None)
        if isinstance(e, ev.ReqArrived):
            runs[e.rid] = RequestRun(arrived=e.iteration, arrived_ts=e.ts)
        r = runs.get(rid) if rid is not None else None
        if r is None:
            continue
        if isinstance(e, ev.ReqAdmitted) and r.admitted is None:
            r.admitted = e.iteration
        elif isinstance(e, ev.CacheMatched) and e.reason:
            r.cached += e.matched_len
        elif isinstance(e, ev.ReqRetracted):
            r.retracts += 1
        elif isinstance(e, ev.ReqChunked):
            r.chunks += 1
        elif isinstance(e, ev.TokensEmitted) and e.token_ids:
            if r.first_token is None:
                r.first_token, r.first_token_s = e.iteration, e.ts - r.arrived_ts
            r.output.extend(e.token_ids)
        elif isinstance(e, (ev.ReqFinished, ev.ReqAborted)):
            r.finish = e.reason
    return runs


def diff_table(a: list[ev.Event], b: list[ev.Event]) -> tuple[list[str], list[list[str]]]:
    """Per request in either run: wait, TTFT (iterations; seconds), cache hits,
    retracts, chunks and whether the output tokens are the same, as ``a -> b``."""
    ra, rb = summarize(a), summarize(b)

    def pair(x: Any, y: Any) -> str:
        return str(x) if x == y else f"{x} -> {y}"

    rows = []
    for rid in list(ra) + [r for r in rb if r not in ra]:
        x, y = ra.get(rid, RequestRun()), rb.get(rid, RequestRun())
        same = next((f"differ at token {i}" for i, (s, t) in enumerate(zip(x.output, y.output)) if s != t),
                    "same" if x.output == y.output else f"{len(x.output)} -> {len(y.output)} tokens")
        secs = pair(*(f"{v:.3f}" if v is not None else "-" for v in (x.first_token_s, y.first_token_s)))
        rows.append([rid, pair(x.wait, y.wait), pair(x.ttft, y.ttft), secs, pair(x.cached, y.cached),
                     pair(x.retracts, y.retracts), pair(x.chunks, y.chunks), same])
    return ["rid", "wait (iters)", "ttft (iters)", "ttft (s)", "cached tokens", "retracts", "chunks", "output"], rows


# --- sglite replay ------------------------------------------------------------------------


def add_command(sub: Any) -> None:
    """``sglite replay --rerun FILE [server-arg overrides]`` / ``--diff A B``."""
    import argparse

    from sglite.server_args import ServerArgs

    p = sub.add_parser("replay", help="rerun a recording deterministically, or diff two runs (docs/why.md)",
                       description="--rerun FILE: run a --record recording again, the same requests arriving in the "
                                   "same iterations; with no server-argument overrides its events and tokens must "
                                   "equal the recording's (exit 1 where they part). --diff A B: per request, what "
                                   "changed between two recordings.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--rerun", metavar="FILE", help="a recording made with --record")
    what.add_argument("--diff", nargs=2, metavar=("A", "B"), help="two recordings of the same requests")
    p.add_argument("--out", metavar="FILE", help="where --rerun records the new run (default: FILE.rerun.jsonl)")
    ServerArgs.add_cli_args(p)  # overrides for --rerun; unset ones keep the recording's
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    for action in p._actions:
        if action.dest in names:
            action.default = argparse.SUPPRESS
    p.set_defaults(func=_run_command)
    e = sub.add_parser("explain", help="a request's history in words, from a --record recording (docs/why.md)")
    e.add_argument("recording", help="a file written by --record (sglite generate, serve or tui)")
    e.add_argument("rid", nargs="+", help="the request id(s)")
    e.set_defaults(func=_run_explain)


def _run_explain(args: Any) -> int:
    try:
        events = list(ev.load_events(args.recording))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{args.recording} is not an sglite recording (--record writes one): {e}") from None
    from sglite.explain import explain  # (imports torch: after the file is known good)

    for rid in args.rid:
        try:
            print(explain(events, rid))
        except KeyError as e:
            raise ValueError(e.args[0]) from None
    return 0


def _run_command(args: Any) -> int:
    from sglite.cli import check_output_path
    from sglite.server_args import ServerArgs

    if args.diff:
        a, b = (list(ev.load_events(path)) for path in args.diff)
        _print_table(*diff_table(a, b))
        return 0
    rec = load(args.rerun)
    overrides = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(ServerArgs)}}
    ServerArgs(**{**rec.server_args, **overrides})  # a bad override is one line, before anything loads
    out = args.out or (args.rerun[: -len(".jsonl")] if args.rerun.endswith(".jsonl") else args.rerun) + ".rerun.jsonl"
    check_output_path(out, "--out")
    changed = {k: v for k, v in overrides.items() if rec.server_args.get(k) != v}
    n_reqs = sum(len(v) for v in rec.arrivals.values())
    print(f"rerunning {n_reqs} request(s) of {args.rerun}" + "".join(
        f"\n  {k}: {rec.server_args.get(k)!r} -> {v!r}" for k, v in changed.items()), flush=True)
    events = rerun(rec, overrides, out)
    print(f"recorded the rerun to {out}")
    if changed:
        _print_table(*diff_table(rec.events, events))
        return 0
    where = first_difference(rec.events, events)
    if where is not None:
        print(f"differs: {where}")
        return 1
    tokens = sum(len(r.output) for r in summarize(events).values())
    print(f"identical: {len(comparable(events, min(rec.arrivals)))} events, {n_reqs} request(s), {tokens} output tokens "
          "(timestamps aside)")
    return 0


def format_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The header and the rows as lines of left-aligned columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    print("\n".join(format_table(header, rows)))
