"""Two recordings side by side (`sglite tui --replay A --compare B`, tui/compare.py):
stepped together by iteration, the first difference found where the schedulers first
decided differently, rows the other run lacks marked, the per-request diff on `r`."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from sglite import events as ev
from sglite.replay import load, rerun
from tests.test_replay import PRESSURE, record
from tui.compare import CompareApp, Run, differences
from tui.widgets import RowTable, TextLines


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[ev.Event]]:
    """fcfs and lpm on shared prefixes; a pool-pressure run, its exact rerun, and its
    rerun with a ten times larger pool."""
    d = tmp_path_factory.mktemp("compare")
    record(d / "fcfs.jsonl", n=24, max_total_tokens=4000, schedule_policy="fcfs")
    record(d / "tight.jsonl", n=24, **PRESSURE)
    fcfs, tight = load(str(d / "fcfs.jsonl")), load(str(d / "tight.jsonl"))
    return {"fcfs": fcfs.events, "lpm": rerun(fcfs, {"schedule_policy": "lpm"}), "tight": tight.events,
            "same": rerun(tight), "roomy": rerun(tight, {"max_total_tokens": 4000}), "dir": d}


def batches(events: list[ev.Event]) -> dict[int, tuple]:
    """Iteration -> the batch it planned (mode, and per request the tokens reused and computed)."""
    return {e.iteration: (e.forward_mode, e.rids, e.prefix_lens, e.extend_lens)
            for e in events if isinstance(e, ev.BatchPlanned)}


def test_an_exact_rerun_decides_the_same_everywhere(runs):
    app = CompareApp(Run.of("A", runs["tight"]), Run.of("B", runs["same"]))
    assert app.differing == [] and len(app.iterations) > 50
    assert all(differences(*(run.at(it)[0] for run in app.runs)) == [] for it in app.iterations)


def test_keys_step_both_runs_to_where_lpm_and_fcfs_part(runs):
    a, b = Run.of("A fcfs", runs["fcfs"]), Run.of("B lpm", runs["lpm"])
    ba, bb = batches(runs["fcfs"]), batches(runs["lpm"])
    first = min(it for it in set(ba) | set(bb) if ba.get(it) != bb.get(it))

    async def scenario():
        app = CompareApp(a, b)
        async with app.run_test(size=(160, 45)) as pilot:
            assert f"first difference at iter {first}" in app.query_one("#titlebar").render().plain
            await pilot.press("end", "F")  # from the last iteration to the last difference before it
            last = len(app.iterations) - 1
            assert app.iteration == app.iterations[max(i for i in app.differing if i < last)]
            await pilot.press(*["F"] * len(app.differing))  # back to the first difference, and no further
            assert app.iteration == first
            va, vb = a.at(first)[0], b.at(first)[0]
            diff = app.query_one("#diff", TextLines).plain
            assert diff.startswith(f"batch: A {va.forward_mode} {len(va.plan)} req(s) {va.plan_rows} rows · B ")
            only_a = {p[0] for p in va.plan} - {p[0] for p in vb.plan}
            assert only_a and app.query_one("#a-plan", RowTable).marked == frozenset(only_a)
            assert "schedule_policy 'fcfs' -> 'lpm'" in app.query_one("#titlebar").render().plain
            await pilot.press("f")
            assert app.iteration == app.iterations[app.differing[1]]
            await pilot.press("r")
            table = app.query_one("#diff", TextLines).plain.splitlines()
            assert table[0].split() == ["rid", "wait", "(iters)", "ttft", "(iters)", "cached", "tokens", "retracts",
                                        "chunks", "output"]
            gained = [line.split()[0] for line in table[1:-1] if "0 -> 40" in line]
            assert gained and all(sum(1 for e in runs["lpm"] if isinstance(e, ev.CacheMatched) and e.rid == rid
                                      and e.matched_len == 40) for rid in gained)
            await pilot.press("q")

    asyncio.run(scenario())


def test_a_run_that_ends_first_shows_its_last_state(runs):
    a, b = Run.of("A", runs["tight"]), Run.of("B", runs["roomy"])
    assert b.views[-1].iteration < a.views[-1].iteration  # ten times the pool: no retraction, done sooner

    async def scenario():
        app = CompareApp(a, b)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("end")
            assert app.query_one("#b-head", TextLines).plain.splitlines()[0] == \
                f"B  (ended at iter {b.views[-1].iteration})"
            assert "finished A 24 B 24" not in app.query_one("#diff", TextLines).plain
            await pilot.press("left")
            assert app.iteration == app.iterations[-2]
            await pilot.press("q")

    asyncio.run(scenario())
    retracted_a = max(v.retractions for v in a.views)
    assert retracted_a > 0 and max(v.retractions for v in b.views) == 0


def test_compare_command_line_errors(runs):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "sglite.cli", "tui", *args], capture_output=True, text=True,
                              timeout=120)

    proc = run("--compare", str(runs["dir"] / "fcfs.jsonl"))
    assert proc.returncode == 2 and proc.stderr == "error: --compare B needs --replay A: it shows two recordings " \
                                                   "side by side\n"
    proc = run("--replay", str(runs["dir"] / "fcfs.jsonl"), "--compare", str(runs["dir"] / "missing.jsonl"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: cannot read") and proc.stderr.count("\n") == 1
    proc = run("--replay", str(runs["dir"] / "fcfs.jsonl"), "--compare", str(runs["dir"] / "tight.jsonl"))
    assert proc.returncode == 2 and "not one (piped or redirected)" in proc.stderr  # both good: needs a terminal


def test_a_tp_run_shows_each_rank_s_forward_time():
    from sglite import events as ev
    from tui.app import tp_forward_line
    from tui.state import ViewBuilder

    b = ViewBuilder()
    b.apply(ev.ForwardFinished(iteration=1, ts=1.0, bid=1, forward_mode="DECODE",
                               tp_timings=((0.0121, 0.0032), (0.0118, 0.0029))))
    view = b.apply(ev.IterationFinished(iteration=1, ts=1.0, bid=1))
    assert view.tp_timings == ((0.0121, 0.0032), (0.0118, 0.0029))
    assert tp_forward_line(view.tp_timings) == "fwd ms TP0 12.1 TP1 11.8 (all-reduce 3.2)"
    assert ViewBuilder().apply(ev.IterationFinished(iteration=1, ts=1.0)).tp_timings == ()
