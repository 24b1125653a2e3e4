"""The TUI under Textual's pilot: tiny-random on the pool-pressure workload, stepped
until a retract, and what each panel shows then; keys pause, step and add prompts."""

from __future__ import annotations

import asyncio

import pytest

from sglite.engine import Engine
from tui.app import SchedulerApp
from tui.workloads import builtin, load


def make_app(paused=True, start_worker=False):
    wl = builtin("pool-pressure")
    engine = Engine("tiny-random", log_level="error", **wl.server_args)
    return SchedulerApp(engine, wl, paused=paused, start_worker=start_worker)


def table_rows(app, tid):
    t = app.query_one(f"#{tid}")
    return [[str(c) for c in t.get_row_at(i)] for i in range(t.row_count)]


def test_panels_after_the_first_retract():
    async def scenario():
        app = make_app()
        async with app.run_test(size=(200, 50)) as pilot:
            sched = app.engine.scheduler
            for _ in range(500):
                view = app.worker.step()
                if sched.num_retracted_reqs:
                    break
            assert sched.num_retracted_reqs > 0
            app.render_view(view)
            await pilot.pause()
            waiting = table_rows(app, "waiting")
            assert {r[0] for r in waiting} == {r.rid for r in sched.waiting_queue}
            assert any(r.is_retracted for r in sched.waiting_queue)
            running = table_rows(app, "running")
            assert {r[0] for r in running} == {r.rid for r in sched.running_reqs()}
            plan = table_rows(app, "plan")
            assert [r[0] for r in plan] == [r.rid for r in sched.cur_batch.reqs]
            assert app.query_one("#plan").border_title.startswith(f"this round: {sched.cur_batch.forward_mode.name}")
            pool = str(app.query_one("#pool").render())
            assert f"retracted {sched.num_retracted_reqs}" in pool and f"/ {sched.max_total_num_tokens}" in pool
            log_text = "\n".join(str(line) for line in app.query_one("#log").lines)
            assert "retract" in log_text and "new_token_ratio" in log_text
            tree = app.query_one("#tree")
            assert len(tree.root.children) == len([n for n in sched.tree_cache.snapshot() if n["parent_id"] == 0])

    asyncio.run(scenario())


def test_keys_step_pause_and_add_prompt():
    async def scenario():
        app = make_app(paused=True, start_worker=True)
        async with app.run_test(size=(120, 40)) as pilot:
            sched = app.engine.scheduler
            assert sched.iteration == 0
            await pilot.press("n")
            for _ in range(100):
                await pilot.pause(0.02)
                if sched.iteration >= 1:
                    break
            await pilot.pause(0.2)
            assert sched.iteration == 1  # exactly one iteration while paused
            await pilot.press("a")
            await pilot.press(*"hello")
            await pilot.press("enter")
            await pilot.pause()
            assert any("submitted" in line for line in app.worker.log)
            await pilot.press("p")
            assert sched.server_args.schedule_policy == "lpm"
            await pilot.press("space")  # run
            for _ in range(1200):
                await pilot.pause(0.05)
                with app.worker.lock:  # not mid-iteration: admitted requests are in no queue then
                    done = not sched.has_work() and not app.worker.pending
                if done:
                    break
            assert app.worker.finished == len(builtin("pool-pressure").arrivals) + 1
            await pilot.press("q")

    asyncio.run(scenario())


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


def snapshot_app(steps: int):
    wl = builtin("pool-pressure")
    engine = Engine("tiny-random", log_level="error", **wl.server_args)
    # one "second" per iteration: the throughput shown is deterministic
    app = SchedulerApp(engine, wl, paused=True, start_worker=False,
                       clock=lambda: float(engine.scheduler.iteration))
    for _ in range(steps):
        view = app.worker.step()

    async def show(pilot):
        app.render_view(view)
        await pilot.pause()

    return app, show


@pytest.mark.parametrize("steps,size", [(3, (200, 50)), (60, (200, 50)), (60, (80, 24))])
def test_main_screen_snapshots(snap_compare, steps, size):
    """Fixed states: after the first prefills, and past the first retraction."""
    app, show = snapshot_app(steps)
    assert snap_compare(app, terminal_size=size, run_before=show)
