"""The TUI under Textual's pilot, on tiny-random with the pool-pressure workload: what
each panel shows, the keys, the request detail, replay of a recording (the same panels
as live at every iteration), the engine process, and SVG snapshots of fixed states."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

from sglite import events as ev
from sglite.engine import Engine
from tui.app import DetailScreen, LiveFeed, SchedulerApp
import tui.host
from tui.host import EngineHost, HostConnection, serve_in_process, serve_in_thread
from tui.state import HELD_WORDS, ViewBuilder, build_views
from tui.workloads import builtin, load

WORKLOAD = builtin("pool-pressure")


def make_engine(**kw) -> Engine:
    return Engine("tiny-random", log_level="error", **{**WORKLOAD.server_args, **kw})


def by_hand(engine: Engine, paused: bool = True) -> tuple[EngineHost, HostConnection]:
    """A host the test steps itself: deterministic, no thread."""
    inbox: queue.Queue = queue.Queue()
    outbox: queue.Queue = queue.Queue()
    return EngineHost(engine, WORKLOAD, outbox, paused), HostConnection(inbox, outbox)


def paused_app(**kw) -> tuple[Engine, EngineHost, HostConnection, SchedulerApp]:
    """A live app, paused, over an engine the test steps by hand."""
    engine = make_engine(**kw)
    host, conn = by_hand(engine)
    return engine, host, conn, SchedulerApp(LiveFeed(conn, {}), title="test", paused=True)


def table_rows(app, tid):
    return [list(r) for r in app.query_one(f"#{tid}").rows]


def panel_texts(app) -> dict:
    """Everything the panels show, as text."""
    return {
        **{tid: table_rows(app, tid) for tid in ("waiting", "running", "plan")},
        "plan_title": (app.query_one("#plan").border_title, app.query_one("#plan").border_subtitle),
        "pool": app.query_one("#pool").plain,
        "tree": app.query_one("#tree").lines,
        "log": [str(line.text) for line in app.query_one("#log").lines],
    }


def test_panels_after_the_first_retract():
    async def scenario():
        engine = make_engine(disable_overlap_schedule=False)  # the plan's border names both batches
        host, conn = by_hand(engine)
        app = SchedulerApp(LiveFeed(conn, {}), title="test", paused=True)
        async with app.run_test(size=(200, 50)) as pilot:
            sched = engine.scheduler
            for _ in range(500):
                host.step()
                if sched.observer.num_retracted_reqs:
                    break
            assert sched.observer.num_retracted_reqs > 0
            app._tick()
            await pilot.pause()
            waiting = table_rows(app, "waiting")
            assert [r[0] for r in waiting] == [r.rid for r in sched.waiting_queue]
            assert any(r.is_retracted for r in sched.waiting_queue)
            chunked = [sched.chunked_req.rid] if sched.chunked_req is not None else []
            assert [r[0] for r in table_rows(app, "running")] == [r.rid for r in sched.running_reqs()] + chunked
            plan = table_rows(app, "plan")
            assert [r[0] for r in plan] == [r.rid for r in sched.cur_batch.reqs]
            assert app.query_one("#plan").border_title.startswith(f"iter {sched.iteration} ran #{sched.forward_ct}: "
                                                                 f"{sched.cur_batch.forward_mode.name}")
            assert app.query_one("#plan").border_subtitle == f"#{sched.forward_ct} in flight, #{sched.forward_ct - 1} processed"
            pool = app.query_one("#pool").plain
            assert f"retracted {sched.observer.num_retracted_reqs}" in pool
            m = sched.observer.cache_miss_tokens  # the scheduler's counters, the TUI's from the events
            assert f"miss: new {m['new']} past {m['past_shared']} evicted {m['evicted']} page {m['page_tail']}" in pool
            assert app.query_one("#poolbox").border_title == f"KV pool: {sched.max_total_num_tokens} tokens"
            log_text = "\n".join(panel_texts(app)["log"])
            assert "retract" in log_text and "new_token_ratio" in log_text
            top = [label for depth, label in app.query_one("#tree").lines if depth == 0]
            assert len(top) == len([n for n in sched.tree_cache.snapshot() if n.parent_id == 0])
            # the why column: the budget that held each request (ReqHeld), in the TUI's words;
            # '' for one retracted after this round's admission (not offered yet)
            for _ in range(200):
                if any(r.hold for r in sched.waiting_queue):
                    break
                host.step()
            assert any(r.hold for r in sched.waiting_queue)
            app._tick()
            await pilot.pause()
            assert [r[-1] for r in table_rows(app, "waiting")] == [
                HELD_WORDS[r.hold.budget] if r.hold else "" for r in sched.waiting_queue]

    asyncio.run(scenario())


YIELD_CHECK = """
import multiprocessing, os, queue
from tui.host import SCREEN_NICE, HostConnection, yield_cpu_to_engine
before = os.getpriority(os.PRIO_PROCESS, 0)
yield_cpu_to_engine(HostConnection(queue.Queue(), queue.Queue(), worker=None))  # an engine in this process
same = os.getpriority(os.PRIO_PROCESS, 0)
yield_cpu_to_engine(HostConnection(None, None, worker=multiprocessing.get_context("spawn").Process()))
print(before, same, os.getpriority(os.PRIO_PROCESS, 0), SCREEN_NICE)
"""


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no nice(2) here")
def test_the_screen_yields_the_cpu_only_to_an_engine_in_another_process():
    """(In a process of its own: the priority, once lowered, stays lowered.)"""
    out = subprocess.run([sys.executable, "-c", YIELD_CHECK], capture_output=True, text=True, check=True).stdout
    before, same, after, nice = map(int, out.split())
    assert same == before
    assert after == min(before + nice, 19)


def test_frames_drawn_line_by_line_equal_a_full_repaint():
    """The panels repaint only the lines that changed, and the plan only its border when
    its title changes: after many such frames the screen must be what a repaint from
    scratch (a resize away and back) draws."""
    async def scenario():
        engine = make_engine(disable_overlap_schedule=False)
        host, conn = by_hand(engine)
        app = SchedulerApp(LiveFeed(conn, {}), title="test", paused=True)

        async def same_after_a_full_repaint() -> None:
            framed = app.export_screenshot(simplify=True)
            assert f"#{engine.scheduler.forward_ct}" in framed
            await pilot.resize_terminal(90, 30)
            await pilot.pause()
            await pilot.resize_terminal(120, 40)
            await pilot.pause()
            assert app.export_screenshot(simplify=True) == framed

        async with app.run_test(size=(120, 40)) as pilot:
            for i in range(80):
                host.step()
                app._tick()
                await pilot.pause()
                if i == 20:
                    assert app.query_one("#running").rows
                    await pilot.press("s")  # a selection changes only a row's style
                    await pilot.pause()
                    assert app.selected == app.query_one("#running").rows[0][0]
                    await same_after_a_full_repaint()
            assert engine.scheduler.observer.num_retracted_reqs > 0  # the queues grew and shrank on the way
            await same_after_a_full_repaint()

    asyncio.run(scenario())


@pytest.mark.parametrize("overlap", [True, False])
def test_views_match_the_scheduler_at_every_iteration(overlap):
    """The panels are built from events only; they must agree with the scheduler."""
    engine = make_engine(disable_overlap_schedule=not overlap)
    host, conn = by_hand(engine)
    builder = ViewBuilder()
    sched = engine.scheduler
    for _ in range(400):
        host.step()
        (view,) = [v for kind, evs in conn.drain() if kind == "events" for v in map(builder.apply, evs) if v is not None]
        assert view.iteration == sched.iteration
        assert [(w[0], w[2]) for w in view.waiting] == [(r.rid, len(r.prefix_indices)) for r in sched.waiting_queue]
        chunked = [sched.chunked_req] if sched.chunked_req is not None else []  # (being chunk-prefilled)
        assert [(r[0], r[1]) for r in view.running] == [(r.rid, r.seqlen) for r in sched.running_reqs() + chunked]
        batch = sched.cur_batch
        assert [p[0] for p in view.plan] == ([r.rid for r in batch.reqs] if batch else [])
        assert view.plan_rows == (len(batch.input_ids) if batch else 0)
        assert (view.pool_free, view.pool_evictable) == (sched.token_to_kv_pool_allocator.available_size(),
                                                         sched.tree_cache.evictable_size())
        snap = sched.tree_cache.snapshot()
        assert [(n.id, n.lock_ref) for n in view.tree] == [(n.id, n.lock_ref) for n in snap]
        assert view.retractions == sched.observer.num_retracted_reqs
        if not sched.has_work() and not host.pending:
            break
    assert view.finished == len(WORKLOAD.arrivals) and view.retractions > 0


def shipments_until_idle(conn: HostConnection, timeout: float = 120.0) -> list[list[ev.Event]]:
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        out += [evs for kind, evs in conn.drain() if kind == "events"]
        done = out and sum(isinstance(e, ev.ReqFinished) for evs in out for e in evs) == len(WORKLOAD.arrivals)
        if done:
            return out
        time.sleep(0.02)
    raise AssertionError("the host did not finish the workload")


def test_running_host_ships_every_iteration_with_one_snapshot_per_shipment(monkeypatch):
    """Running freely, the host batches iterations into shipments; every iteration's events
    arrive, and the newest iteration of each shipment has a snapshot equal to what the
    scheduler emits itself (the screen draws only that one)."""
    monkeypatch.setattr(tui.host, "SHIP_INTERVAL", 3600.0)  # ship only when the work runs out
    engine = make_engine()
    conn = serve_in_thread(engine, WORKLOAD, paused=False)
    try:
        conn.wait_ready()
        shipments = shipments_until_idle(conn)
    finally:
        conn.close()
    assert len(shipments) == 1
    (events,) = shipments
    done = [e.iteration for e in events if isinstance(e, ev.IterationFinished)]
    assert done == list(range(1, engine.scheduler.iteration + 1)) and len(done) > 50
    snaps = [e for e in events if isinstance(e, ev.SchedulerSnapshot)]
    assert [s.iteration for s in snaps] == [done[-1]] and events[-2] is snaps[0]
    builder = ViewBuilder()
    views = [v for v in map(builder.apply, events) if v is not None]
    assert [v.has_snapshots for v in views] == [False] * (len(views) - 1) + [True]
    assert views[-1].finished == len(WORKLOAD.arrivals) and views[-1].running == [] and views[-1].waiting == []
    # the same state the scheduler reports to a snapshot subscriber of its own
    log = ev.EventLog()
    engine.event_bus.subscribe(log, snapshots=True)
    engine.step()
    (own,) = log.of(ev.SchedulerSnapshot)
    fields = ("waiting", "running", "pool_free", "pool_evictable", "tree", "matched_node", "policy")
    assert {f: getattr(own, f) for f in fields} == {f: getattr(snaps[0], f) for f in fields}


def test_a_pause_ships_what_ran_before_it():
    """Whatever iterations ran before a command reach the screen at once, the newest with
    a snapshot of the state the engine then holds still."""
    engine = make_engine()
    conn = serve_in_thread(engine, WORKLOAD, paused=False)
    try:
        conn.wait_ready()
        time.sleep(0.05)
        conn.send("pause")
        builder, last = ViewBuilder(), None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for kind, evs in conn.drain():
                for v in map(builder.apply, evs) if kind == "events" else ():
                    if v is not None:
                        last = v
            if last is not None and last.iteration == engine.scheduler.iteration:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # nothing runs while paused
        assert [m for m in conn.drain() if m[0] == "events"] == [] and last.iteration == engine.scheduler.iteration and last.has_snapshots
        sched = engine.scheduler
        chunked = [sched.chunked_req.rid] if sched.chunked_req is not None else []
        assert [r[0] for r in last.running] == [r.rid for r in sched.running_reqs()] + chunked
        assert [w[0] for w in last.waiting] == [r.rid for r in sched.waiting_queue]
    finally:
        conn.close()


def test_keys_step_pause_add_prompt_policy_and_workload():
    async def scenario():
        engine = make_engine()
        conn = serve_in_thread(engine, WORKLOAD, paused=True)
        info = conn.wait_ready()
        app = SchedulerApp(LiveFeed(conn, info), title="test", paused=True)
        async with app.run_test(size=(120, 40)) as pilot:
            builder = app.feed.builder
            await pilot.press("n")
            for _ in range(100):
                await pilot.pause(0.05)
                if app.last_view is not None:
                    break
            await pilot.pause(0.3)
            assert app.last_view.iteration == 1  # exactly one iteration while paused
            await pilot.press("a", *"hello", "enter")
            await pilot.press("p")
            await pilot.press("w", *"steady", "enter")
            for _ in range(100):
                await pilot.pause(0.05)
                if any("workload steady" in line for line in builder.log):
                    break
            log = "\n".join(builder.log)
            assert "submitted r12" in log and "policy -> lpm" in log and "workload steady: 24 requests" in log
            await pilot.press("space")  # run
            expected = len(WORKLOAD.arrivals) + 1 + len(builtin("steady").arrivals)
            for _ in range(2400):
                await pilot.pause(0.05)
                if builder.finished == expected:
                    break
            assert builder.finished == expected
            assert app.last_view.policy == "lpm"
            await pilot.press("s", "d")
            await pilot.pause()
            assert isinstance(app.screen, DetailScreen)
            body = str(app.screen.query_one("#detail-body").render())
            assert "arrived" in body and "admitted" in body and "finished" in body
            await pilot.press("escape")
            await pilot.press("q")

    asyncio.run(scenario())


def test_while_running_the_tree_and_log_catch_up_within_the_interval(monkeypatch):
    """Running, the radix tree and the events log are redrawn at most every
    SLOW_PANELS_INTERVAL (their layout passes cost a whole-screen repaint); the tables
    show every view; once the interval passes, or on pause, all panels show the newest."""
    import tui.app as tui_app

    now = [1000.0]
    monkeypatch.setattr(tui_app, "monotonic", lambda: now[0])

    async def scenario():
        engine = make_engine()
        host, conn = by_hand(engine)
        app = SchedulerApp(LiveFeed(conn, {}), title="test", paused=False)
        async with app.run_test(size=(200, 50)) as pilot:
            host.step()
            app._tick()  # the first view: everything drawn
            await pilot.pause()
            drawn = panel_texts(app)
            assert app.last_view.iteration == 1
            for _ in range(60):  # run until the log has news
                host.step()
                if len(app.feed.builder.log) > len(drawn["log"]):
                    break
            now[0] += tui_app.SLOW_PANELS_INTERVAL / 2
            app._tick()
            await pilot.pause()
            lagging = panel_texts(app)
            assert lagging["running"] != drawn["running"] or lagging["plan"] != drawn["plan"]
            assert lagging["log"] == drawn["log"] and lagging["tree"] == drawn["tree"]
            now[0] += tui_app.SLOW_PANELS_INTERVAL
            app._tick()  # no new view: the stale panels are drawn
            await pilot.pause()
            caught_up = panel_texts(app)
            assert caught_up["log"] != drawn["log"] and caught_up["log"][-1] in app.feed.builder.log[-1]
            host.step()
            now[0] += tui_app.SLOW_PANELS_INTERVAL / 2
            app._tick()
            await pilot.pause()
            await pilot.press("space")  # pause: the newest view, every panel
            await pilot.pause()
            assert app.paused and panel_texts(app)["log"][-1] in app.feed.builder.log[-1]

    asyncio.run(scenario())


def test_space_runs_at_start_and_a_click_on_a_row_opens_that_request():
    async def scenario():
        engine = make_engine()
        host, conn = by_hand(engine)
        app = SchedulerApp(LiveFeed(conn, {}), title="test", paused=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("space")  # nothing focused takes the key first
            assert not app.paused and conn.inbox.get_nowait() == ("run",)
            for _ in range(3):
                host.step()
            await pilot.pause(0.1)
            running = table_rows(app, "running")
            assert len(running) >= 2
            # border, then the header line: the second request's row is the table's fourth line
            await pilot.click("#running", offset=(3, 3))
            await pilot.pause()
            assert isinstance(app.screen, DetailScreen) and app.screen.rid == running[1][0]
            await pilot.press("escape")
            assert app.query_one("#running").selected == running[1][0]
            await pilot.press("q")

    asyncio.run(scenario())


def no_rate(panels: dict) -> dict:
    """The panels less the tok/s line: live and paused it says "paused: 0 tok/s", a replay
    the rate as of its iteration."""
    return {**panels, "pool": re.sub(r"\n(paused: 0|[\d.]+) tok/s", "", panels["pool"])}


def test_replay_shows_the_live_panels_at_every_iteration(tmp_path):
    rec_path = tmp_path / "run.jsonl"

    async def live():
        engine = make_engine(chunked_prefill_size=64)
        rec = ev.EventRecorder(str(rec_path))
        engine.event_bus.subscribe(rec, snapshots=True)
        host, conn = by_hand(engine)
        app = SchedulerApp(LiveFeed(conn, {}), title="test", paused=True)
        shown = {}
        async with app.run_test(size=(200, 50)) as pilot:
            for _ in range(400):
                host.step()
                app._tick()
                await pilot.pause()
                shown[app.last_view.iteration] = panel_texts(app)
                if not engine.scheduler.has_work() and not host.pending:
                    break
        rec.close()
        return shown

    async def replay(shown):
        views, builder = build_views(list(ev.load_events(str(rec_path))))
        assert [v.iteration for v in views] == sorted(shown)
        app = SchedulerApp(views=views, builder=builder, title="replay")
        async with app.run_test(size=(200, 50)) as pilot:
            for k in range(len(views)):
                app.show_index(k)
                await pilot.pause()
                assert no_rate(panel_texts(app)) == no_rate(shown[views[k].iteration]), f"iteration {views[k].iteration}"
            for k in (len(views) // 2, 3):  # backwards too
                app.show_index(k)
                await pilot.pause()
                assert no_rate(panel_texts(app)) == no_rate(shown[views[k].iteration])
            await pilot.press("left")
            assert app.index == 2

    shown = asyncio.run(live())
    assert any("retract" in line for p in shown.values() for line in p["log"])
    asyncio.run(replay(shown))


def test_replay_command_line_errors(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "sglite.cli", "tui", *args], capture_output=True, text=True,
                              timeout=120)

    proc = run("--replay", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: cannot read") and proc.stderr.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    proc = run("--replay", str(bad))
    assert proc.returncode == 1 and "not an sglite recording" in proc.stderr and proc.stderr.count("\n") == 1
    bad.write_text('{"x": 1}\n')
    proc = run("--replay", str(bad))
    assert proc.returncode == 1 and "an event has no 'kind' field" in proc.stderr and proc.stderr.count("\n") == 1
    proc = run("--workload", "nope")
    assert proc.returncode == 2 and "unknown workload" in proc.stderr


def test_waiting_for_an_engine_that_died_or_hangs_ends_with_an_error():
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    conn = HostConnection(queue.Queue(), queue.Queue(), dead)
    with pytest.raises(RuntimeError, match="exited before it was ready"):
        conn.wait_ready(timeout=30)
    with pytest.raises(RuntimeError, match="not ready after 0 s"):
        HostConnection(queue.Queue(), queue.Queue()).wait_ready(timeout=0.2)


def test_engine_process_runs_and_reports_load_errors(tmp_path):
    conn = serve_in_process({"model_path": str(tmp_path / "missing.gguf"), "log_level": "error"}, "steady", True)
    with pytest.raises(RuntimeError) as err:
        conn.wait_ready(timeout=120)
    assert "missing.gguf" in str(err.value) and "Traceback" not in str(err.value)
    conn.close()
    conn = serve_in_process({"model_path": "tiny-random", "log_level": "error", "disable_overlap_schedule": False},
                            "steady", True)
    info = conn.wait_ready(timeout=120)
    assert info["model"] == "tiny-random" and info["overlap"] is True
    conn.send("step")
    msg = conn.outbox.get(timeout=60)
    while msg[0] == "state":  # (what the host holds, sent when it changes)
        msg = conn.outbox.get(timeout=60)
    assert msg[0] == "events" and any(isinstance(e, ev.IterationFinished) for e in msg[1])
    conn.close()
    assert not conn.worker.is_alive()


def test_workload_file_and_errors(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"at": 0, "prompt": "hi"}\n{"at": 2, "input_ids": [3, 4, 5], "max_new_tokens": 4}\n')
    wl = load(str(f))
    assert [a.at for a in wl.arrivals] == [0, 2] and wl.arrivals[1].max_new_tokens == 4
    with pytest.raises(ValueError, match="unknown workload"):
        load("nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load(str(bad))


def snapshot_app(steps: int, then: str = ""):
    """A live screen after ``steps`` iterations (``steps`` -1: until the workload is done),
    then ``then``: "arriving" (a prompt submitted while paused) or "help" (the ? screen).
    Event times are replaced by the iteration number, so the throughput shown is the same
    on every machine."""
    engine = make_engine(disable_overlap_schedule=False)
    host, conn = by_hand(engine)
    for _ in range(steps if steps >= 0 else 2000):
        if steps < 0 and host.idle():
            break
        host.step()
    if then == "arriving":
        host.handle(("submit", {"prompt": "Why is the sky blue?", "sampling_params": {"max_new_tokens": 8}}))
    msgs = [(kind, [dataclasses.replace(e, ts=float(e.iteration)) for e in payload] if kind == "events" else payload)
            for kind, payload in conn.drain()]
    for m in msgs:
        conn.outbox.put(m)
    app = SchedulerApp(LiveFeed(conn, {}), title="tiny-random", paused=True)

    async def show(pilot):
        app._tick()
        await pilot.pause()
        if then == "help":
            await pilot.press("question_mark")
            await pilot.pause()

    return app, show


@pytest.mark.parametrize("steps,then,size", [(3, "", (200, 50)), (60, "", (200, 50)), (60, "", (80, 24)),
                                             (5, "arriving", (80, 24)), (-1, "", (200, 50)), (-1, "", (80, 24)),
                                             (60, "help", (80, 24)), (60, "help", (200, 50))])
def test_main_screen_snapshots(snap_compare, steps, then, size):
    """Fixed states: after the first prefills, past the first retraction, a prompt arriving
    while paused, the workload done, the help screen."""
    app, show = snapshot_app(steps, then)
    assert snap_compare(app, terminal_size=size, run_before=show)


def test_recording_round_trips_snapshots(tmp_path):
    engine = make_engine()
    log = ev.EventLog()
    engine.event_bus.subscribe(log, snapshots=True)
    engine.submit(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 3})
    for _ in range(5):
        engine.step()
    snaps = log.of(ev.SchedulerSnapshot)
    assert snaps and all(ev.event_from_dict(json.loads(s.to_json())) == s for s in snaps)


def test_the_grammar_queue_shows_in_the_waiting_panel_and_the_mask_in_the_detail():
    """A request whose grammar compiles is a waiting row held by "grammar"; its detail
    tells how long the compile held it and, per token, what the mask allowed and refused."""
    log = ev.EventLog()
    with Engine("tiny-random", log_level="error") as engine:
        engine.event_bus.subscribe(log, snapshots=True)
        backend = engine.scheduler.grammar_manager.grammar_backend
        release, dispatch = threading.Event(), backend.dispatch
        backend.dispatch = lambda key: release.wait(30) and dispatch(key)
        rid = engine.submit("the scheduler", sampling_params={"max_new_tokens": 4, "temperature": 0, "regex": "[0-9]{4}"})
        for _ in range(3):
            engine.step()
        release.set()
        while not engine.is_finished(rid):
            engine.step()
    views, builder = build_views(log.events)
    assert [w for w in views[1].waiting if w[0] == rid][0][4] == HELD_WORDS["grammar"] == "grammar"
    req = builder.requests[rid]
    stages = [what for _, what in req.timeline]
    assert stages[1] == "grammar_queue: its regex grammar compiles"
    assert stages[2].startswith("grammar compiled after ") and stages[2].endswith("iterations: to the waiting_queue")
    lines = req.grammar_lines(views[-1].iteration)
    assert lines[0] == "the mask refused the model's first choice at 4 of 4 tokens"
    assert len(lines) == 5 and all(" allowed; preferred " in x and "refused ->" in x for x in lines[1:])


def test_at_80x24_the_waiting_queue_keeps_its_why_column_and_paused_says_so():
    """The why column is what the help and docs/why.md teach from: on a small terminal
    the queue drops cached, then len, before it; and paused, the rate is not the last one."""
    async def scenario():
        engine, host, conn, app = paused_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert app.query_one("#waiting").plain.startswith("waiting for the engine's first iteration")
            sched = engine.scheduler
            for _ in range(200):
                host.step()
                if any(r.hold is not None and r.hold.budget == "rem_total_tokens" for r in sched.waiting_queue):
                    break
            app._tick()
            await pilot.pause()
            table = app.query_one("#waiting")
            lines = table.plain.splitlines()
            assert lines[0].split() == ["rid", "len", "wait", "why"]
            assert any(line.rstrip().endswith("pool") for line in lines[1:]) and "…" not in table.plain
            assert "paused: 0 tok/s" in app.query_one("#pool").plain
            await pilot.resize_terminal(200, 50)
            await pilot.pause()
            assert app.query_one("#waiting").plain.splitlines()[0].split() == ["rid", "len", "cached", "wait", "why"]
            await pilot.press("q")

    asyncio.run(scenario())


def test_esc_then_a_key_sent_as_one_alt_key_is_both():
    """A terminal sends Esc and a key typed right after it as alt+key (within Textual's
    escape delay, or tmux's escape-time): the help closes and the key still acts."""
    async def scenario():
        engine, host, conn, app = paused_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("question_mark")
            await pilot.pause()
            assert type(app.screen).__name__ == "HelpScreen"
            await pilot.press("alt+n")
            await pilot.pause(0.2)
            assert type(app.screen).__name__ == "Screen" and conn.inbox.get_nowait() == ("step",)
            await pilot.press("question_mark", "alt+q")
            await pilot.pause(0.3)
            assert not app.is_running

    asyncio.run(scenario())


def test_a_request_being_chunk_prefilled_shows_in_the_running_batch():
    """Admitted, its prompt not all computed: in neither queue of the scheduler, it is a
    row of running_batch (as the help says), not missing from both panels."""
    engine = make_engine(chunked_prefill_size=8)
    host, conn = by_hand(engine)
    builder = ViewBuilder()
    rid = engine.submit(input_ids=list(range(3, 40)), sampling_params={"max_new_tokens": 2})
    host.step()
    (view,) = [v for kind, evs in conn.drain() if kind == "events" for v in map(builder.apply, evs) if v is not None]
    assert engine.scheduler.chunked_req is not None and engine.scheduler.chunked_req.rid == rid
    assert [r[0] for r in view.running] == [rid] and rid not in [w[0] for w in view.waiting]


def test_admit_says_the_queue_was_empty_then_refilled_when_a_round_retracts():
    """Admission found the queue empty, then the same round's decode retracted requests
    into it: the pool panel must not say just "queue empty" beside a full queue."""
    engine = make_engine()
    host, conn = by_hand(engine)
    builder = ViewBuilder()
    for _ in range(500):
        host.step()
        views = [v for kind, evs in conn.drain() if kind == "events" for v in map(builder.apply, evs) if v is not None]
        if views and views[-1].admission_stop == "EMPTY_QUEUE_THEN_RETRACT":
            assert views[-1].waiting and views[-1].retractions > 0
            return
    pytest.fail("no round retracted into an empty queue")


def test_opening_a_request_s_detail_clears_the_toasts_that_would_cover_it():
    async def scenario():
        engine, host, conn, app = paused_app()
        async with app.run_test(size=(80, 24)) as pilot:
            for _ in range(3):
                host.step()
            app._tick()
            await pilot.press("s")
            await pilot.pause()
            assert len(app._notifications) == 1  # "selected r0 (d: detail)"
            await pilot.press("d")
            await pilot.pause()
            assert isinstance(app.screen, DetailScreen) and len(app._notifications) == 0
            await pilot.press("escape", "q")

    asyncio.run(scenario())
