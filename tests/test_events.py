"""The event stream: typed events, a bus that costs a branch when unwatched, and JSON
lines that load back into equal events."""

from __future__ import annotations

from sglite import events as ev


def test_bus_without_subscribers_builds_nothing():
    bus = ev.EventBus()
    assert not bus.active
    bus.emit(ev.ReqArrived, rid="x")  # no subscriber: nothing happens


def test_subscribe_emit_unsubscribe():
    bus = ev.EventBus()
    log = ev.EventLog()
    off = bus.subscribe(log)
    bus.iteration = 7
    bus.emit(ev.ReqAdmitted, rid="R2", prefix_len=3, extend_len=3)
    off()
    bus.emit(ev.ReqAdmitted, rid="R3")
    assert not bus.active
    (e,) = log.events
    assert (e.kind, e.iteration, e.rid, e.prefix_len, e.extend_len) == ("ReqAdmitted", 7, "R2", 3, 3)


def test_record_and_load_round_trip(tmp_path):
    path = tmp_path / "run.jsonl"
    rec = ev.EventRecorder(str(path))
    sent = [
        ev.BatchPlanned(iteration=2, forward_mode="EXTEND", rids=("R1", "R2"), seq_lens=(6, 6),
                        prefix_lens=(0, 3), extend_lens=(6, 3), out_cache_loc=tuple(range(1, 10)), num_rows=9),
        ev.ReqRetracted(iteration=3, rid="R1", reason="KV cache pool is full", old_new_token_ratio=0.7,
                        new_token_ratio=0.4, output_tokens=5),
    ]
    for e in sent:
        rec(e)
    rec.close()
    assert list(ev.load_events(str(path))) == sent
