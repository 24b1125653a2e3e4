"""Deterministic re-execution (docs/why.md): a recording rerun with the same server
arguments gives the same events (timestamps aside) and tokens, bit for bit, under
chunking, mixed batches, retraction and both loops; with an override, --diff says per
request what changed."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from sglite import events as ev
from sglite.engine import Engine
from sglite.replay import diff_table, first_difference, header_for, load, rerun, summarize

PRESSURE = {"max_total_tokens": 400, "schedule_conservativeness": 0.05, "chunked_prefill_size": 64}


def record(path, model: str = "tiny-random", n: int = 36, **server_args) -> None:
    """Two waves of requests (a shared system prompt on half, greedy and sampled,
    default and explicit seeds) recorded as --record does."""
    engine = Engine(model, log_level="error", **server_args)
    recorder = ev.EventRecorder(str(path), header_for(engine))
    engine.event_bus.subscribe(recorder, snapshots=True)
    rng = random.Random(0)
    system = [rng.randrange(3, 250) for _ in range(40)]
    prompts = [(system if i % 2 else []) + [rng.randrange(3, 250) for _ in range(rng.randrange(10, 60))]
               for i in range(n)]
    params = [{"max_new_tokens": 20, "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True,
               **({"seed": i} if i % 3 == 0 else {})} for i in range(n)]
    engine.generate(input_ids=prompts[: n // 2], sampling_params=params[: n // 2])
    engine.generate(input_ids=prompts[n // 2:], sampling_params=params[n // 2:])
    engine.shutdown()
    recorder.close()


@pytest.mark.parametrize("extra", [{}, {"disable_overlap_schedule": True}, {"enable_mixed_chunk": True},
                                   {"disable_overlap_schedule": True, "enable_mixed_chunk": True}])
def test_a_rerun_makes_the_same_events_and_tokens(tmp_path, extra):
    record(tmp_path / "a.jsonl", **PRESSURE, **extra)
    rec = load(str(tmp_path / "a.jsonl"))
    assert any(isinstance(e, ev.ReqRetracted) for e in rec.events) and any(isinstance(e, ev.ReqChunked) for e in rec.events)
    events = rerun(rec, out_path=str(tmp_path / "b.jsonl"))
    assert first_difference(rec.events, events) is None
    again = load(str(tmp_path / "b.jsonl"))  # the rerun is itself a recording
    assert first_difference(rec.events, again.events) is None
    assert {r: s.output for r, s in summarize(events).items()} == {r: s.output for r, s in summarize(rec.events).items()}


def test_a_client_abort_is_replayed_in_its_iteration(tmp_path):
    engine = Engine("tiny-random", log_level="error", **PRESSURE)
    recorder = ev.EventRecorder(str(tmp_path / "a.jsonl"), header_for(engine))
    engine.event_bus.subscribe(recorder, snapshots=True)
    rids = [engine.submit(input_ids=[5 + i] * 30, sampling_params={"max_new_tokens": 30, "ignore_eos": True})
            for i in range(4)]
    for _ in range(6):
        engine.step()
    engine.abort(rids[1])
    while engine.scheduler.has_work():
        engine.step()
    engine.shutdown()
    recorder.close()
    rec = load(str(tmp_path / "a.jsonl"))
    (abort,) = [e for e in rec.events if isinstance(e, ev.ReqAborted)]
    assert abort.by_client and abort.rid == rids[1] and abort.iteration == 7
    events = rerun(rec)
    assert first_difference(rec.events, events) is None
    assert summarize(events)[rids[1]].finish == "aborted by user"


def test_a_difference_is_found_and_named(tmp_path):
    record(tmp_path / "a.jsonl", **PRESSURE)
    rec = load(str(tmp_path / "a.jsonl"))
    other = rerun(rec, {"chunked_prefill_size": 32})
    where = first_difference(rec.events, other)
    assert where is not None and where.startswith("event ")


def test_diff_of_lpm_and_fcfs_on_shared_prefixes_shows_the_cache_gain(tmp_path):
    record(tmp_path / "fcfs.jsonl", n=24, max_total_tokens=4000, schedule_policy="fcfs")
    rec = load(str(tmp_path / "fcfs.jsonl"))
    lpm = rerun(rec, {"schedule_policy": "lpm"})
    a, b = summarize(rec.events), summarize(lpm)
    assert sum(r.cached for r in b.values()) > sum(r.cached for r in a.values())
    assert all(a[r].output == b[r].output for r in a)  # a request's tokens do not depend on its batch
    header, rows = diff_table(rec.events, lpm)
    assert header[4] == "cached tokens" and any("->" in row[4] for row in rows)
    assert {row[0] for row in rows} == set(a)


def test_a_recording_without_a_header_or_requests_is_refused(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(ev.ReqFinished(rid="r0").to_dict()) + "\n")
    with pytest.raises(ValueError, match="no RecordingStarted"):
        load(str(path))


def test_cli_rerun_and_diff(tmp_path):
    record(tmp_path / "a.jsonl", n=8, **PRESSURE)
    run = [sys.executable, "-m", "sglite.cli", "replay"]
    same = subprocess.run(run + ["--rerun", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "b.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert same.returncode == 0, same.stderr
    assert "identical: " in same.stdout
    changed = subprocess.run(run + ["--rerun", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "c.jsonl"),
                                    "--max-total-tokens", "4000"], capture_output=True, text=True, timeout=300)
    assert changed.returncode == 0, changed.stderr
    assert "max_total_tokens: 400 -> 4000" in changed.stdout and "retracts" in changed.stdout
    diff = subprocess.run(run + ["--diff", str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert diff.returncode == 0 and "wait (iters)" in diff.stdout and "r0" in diff.stdout
    told = subprocess.run([sys.executable, "-m", "sglite.cli", "explain", str(tmp_path / "a.jsonl"), "r1", "r0"],
                          capture_output=True, text=True, timeout=300)
    assert told.returncode == 0 and told.stdout.startswith("r1\n  iteration 1: arrived") and "\nr0\n" in told.stdout
    bad = subprocess.run([sys.executable, "-m", "sglite.cli", "explain", str(tmp_path / "a.jsonl"), "zz"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: no request 'zz' in this history (an unknown rid, or one older than the history)")


@pytest.mark.real_model
@pytest.mark.parametrize("extra", [{}, {"disable_overlap_schedule": True, "enable_mixed_chunk": True}])
def test_a_rerun_on_smollm2_is_bit_for_bit(tmp_path, extra):
    record(tmp_path / "a.jsonl", model="smollm2-135m", n=12, **{**PRESSURE, "max_total_tokens": 300}, **extra)
    rec = load(str(tmp_path / "a.jsonl"))
    assert any(isinstance(e, ev.ReqChunked) for e in rec.events) and any(isinstance(e, ev.ReqRetracted) for e in rec.events)
    modes = {e.forward_mode for e in rec.events if isinstance(e, ev.BatchPlanned)}
    assert ("MIXED" in modes) == bool(extra.get("enable_mixed_chunk"))
    assert first_difference(rec.events, rerun(rec)) is None
