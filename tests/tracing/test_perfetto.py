"""The Chrome/Perfetto export is valid trace-event JSON: every event has ph, ts, pid and
tid; durations are non-negative; complete events on one track nest properly."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import defaultdict

from sglite.engine import Engine
from sglite.events import EventLog, EventRecorder
from tracing.perfetto import events_to_chrome_trace


def run_events(**kw):
    engine = Engine("tiny-random", **kw)
    log = EventLog()
    engine.event_bus.subscribe(log)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(10, 60))] for _ in range(30)]
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    return log.events, engine


def check_valid(trace):
    evs = trace["traceEvents"]
    assert evs
    for e in evs:
        assert {"ph", "ts", "pid", "tid"} <= set(e), e
        assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    tracks = defaultdict(list)
    for e in evs:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    for spans in tracks.values():
        stack = []
        for e in sorted(spans, key=lambda x: (x["ts"], -x["dur"])):
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"] + 1e-3:
                stack.pop()
            if stack:
                assert end <= stack[-1] + 1e-3, f"{e['name']} overlaps its enclosing span"
            stack.append(end)
    return tracks


def test_perfetto_trace_is_valid_and_has_the_tracks():
    events, _ = run_events(max_total_tokens=400, schedule_conservativeness=0.05, chunked_prefill_size=32)
    trace = events_to_chrome_trace(events)
    tracks = check_valid(trace)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"iterations", "forward"} <= names
    # one track per request; in the overlap loop chunk k+1 is planned before chunk k's
    # result is back, so a chunked request also gets a second lane, "req r3 (2)"
    assert len({n.split(" (")[0] for n in names if n.startswith("req ")}) == 30
    assert any(e["name"] == "retract" and e["ph"] == "i" for e in trace["traceEvents"])
    assert any(e["name"].startswith("prefill.chunk[") for e in trace["traceEvents"])
    (fwd_tid,) = [e["tid"] for e in trace["traceEvents"]
                  if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == "forward"]
    assert len(tracks[(1, fwd_tid)]) == sum(1 for e in events if e.kind == "ForwardFinished")


def test_overlap_batches_get_a_second_lane():
    """Overlap loop: batch N's span lasts until its results are processed, after batch
    N+1 is planned; the two overlap, so the export puts them in two lanes."""
    events, _ = run_events(max_total_tokens=2048, chunked_prefill_size=32, disable_overlap_schedule=False)
    trace = events_to_chrome_trace(events)
    check_valid(trace)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"iterations", "iterations (2)", "forward"} <= names
    events, _ = run_events(max_total_tokens=2048, chunked_prefill_size=32, disable_overlap_schedule=True)
    trace = events_to_chrome_trace(events)
    check_valid(trace)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "iterations (2)" not in names and not any(n.endswith("(2)") for n in names)


def test_cli_converts_a_recording(tmp_path):
    events, _ = run_events(max_total_tokens=2048)
    rec_path = tmp_path / "run.jsonl"
    rec = EventRecorder(str(rec_path))
    for e in events:
        rec(e)
    rec.close()
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "trace", "convert", str(rec_path), "--to", "perfetto",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(out.read_text())
    check_valid(trace)
    assert trace == json.loads(json.dumps(events_to_chrome_trace(events)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "trace", "convert", str(bad), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
