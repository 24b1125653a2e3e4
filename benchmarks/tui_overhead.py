"""Engine throughput with and without the TUI attached (headless Textual), and the
screen updates per second. Goals: ratio >= 0.9, >= 10 screen updates/s.

"Engine alone" steps the workload in a process of its own with nothing subscribed and
torch's default threads. "Engine + TUI" is what `sglite tui` runs: the engine in its own
process with `tui.host.engine_threads` torch threads, shipping every
iteration's events (with scheduler snapshots) to the screen, which folds them into
views and draws the newest at most every `tui.app.UI_INTERVAL` seconds; the screen
(a fresh process each run) lowers its CPU priority once the engine has started
(`tui.host.yield_cpu_to_engine`). A third row runs
the engine alone with the TUI's thread count, which splits the ratio into what the core
left to the screen costs and what the screen itself costs. All are timed from the start
of the first iteration to the end of the last. They alternate `--repeats` times and the
medians are compared (a small VM's speed drifts by 10-20 % from run to run).

A screen update draws a new iteration, so the screen cannot update more often than the
engine finishes iterations: the update goal is 10 a second, or every iteration when
the engine makes fewer than 10 a second (smollm2 on 2 cores makes about 6).

    python benchmarks/tui_overhead.py                                  # smollm2-135m, pool-pressure
    python benchmarks/tui_overhead.py --model tiny-random --repeat 20  # hundreds of iterations/s

``--repeat N`` submits the workload N times, a copy every ``--every`` iterations, so a
fast model runs for seconds rather than a fraction of one.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglite import events as ev  # noqa: E402
from sglite.engine import Engine  # noqa: E402
from tui.app import LiveFeed, SchedulerApp  # noqa: E402
from tui.host import engine_threads, serve_in_process, yield_cpu_to_engine  # noqa: E402
from tui.workloads import BUILTIN, Workload, builtin  # noqa: E402

WATCH_INTERVAL = 0.1  # seconds between looks at whether every request finished


@dataclass
class Run:
    seconds: float  # first iteration's start to last iteration's end
    tokens: int
    iterations: int
    updates: int = 0  # screen updates between the first iteration's start and the last one's end
    updates_seconds: float = 0.0
    screen_cpu: float = 0.0  # the screen process's CPU time while the engine ran, in cores
    screen_ms_per_update: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def repeated(name: str, times: int, every: int) -> Workload:
    """The built-in workload ``name``, submitted ``times`` times, a copy every ``every`` iterations."""
    wl = builtin(name)
    arrivals = [a for k in range(times) for a in wl.shifted(k * every)]
    label = wl.name if times == 1 else f"{wl.name} x{times} (every {every} iterations)"
    return Workload(label, wl.description, arrivals, wl.server_args)


def engine_kwargs(model: str, workload: Workload) -> dict:
    return {"model_path": model, "log_level": "error", **workload.server_args}


def without_tui(model: str, workload: Workload, threads: int | None = None) -> Run:
    """The host's loop (arrivals by iteration, one step at a time) with no viewer, on
    ``threads`` torch threads (default: torch's own choice)."""
    import torch

    default = torch.get_num_threads()
    torch.set_num_threads(threads or default)
    try:
        return _without_tui(model, workload)
    finally:
        torch.set_num_threads(default)  # the pool's process runs the next side too


def _without_tui(model: str, workload: Workload) -> Run:
    engine = Engine(**engine_kwargs(model, workload))
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})  # warm up
    pending = sorted(workload.arrivals, key=lambda a: a.at)
    tokens, start = 0, engine.scheduler.iteration
    tic = time.perf_counter()
    while pending or engine.scheduler.has_work():
        while pending and pending[0].at <= engine.scheduler.iteration - start:
            a = pending.pop(0)
            engine.submit(a.prompt, input_ids=a.input_ids, messages=a.messages,
                          sampling_params={"max_new_tokens": a.max_new_tokens, "temperature": 0,
                                           "ignore_eos": a.ignore_eos})
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - tic
    engine.shutdown()
    return Run(seconds, tokens, engine.scheduler.iteration - start)


def with_tui(model: str, workload: Workload) -> Run:
    conn = serve_in_process(engine_kwargs(model, workload), workload, paused=True)
    feed = LiveFeed(conn, conn.wait_ready())
    yield_cpu_to_engine(conn)  # as sglite tui does: this process's priority stays lowered
    app = SchedulerApp(feed, title="benchmark", paused=True)
    n_reqs = len(workload.arrivals)
    iterations: list[ev.IterationFinished] = []
    real_apply = feed.builder.apply

    def apply(e: ev.Event):  # noqa: ANN202
        if isinstance(e, ev.IterationFinished):
            iterations.append(e)
        return real_apply(e)

    feed.builder.apply = apply
    drawn: list[float] = []  # when each screen update happened (monotonic, the events' clock)
    real_render = app.render_view

    def render_view(v):  # noqa: ANN001, ANN202
        drawn.append(time.monotonic())
        return real_render(v)

    app.render_view = render_view

    cpu: list[float] = []  # (process CPU seconds, monotonic seconds) when the engine starts and ends

    async def run() -> None:
        async with app.run_test(size=(200, 50)) as pilot:
            cpu.extend((time.process_time(), time.monotonic()))
            await pilot.press("space")
            # plain sleeps: Pilot.pause forces a repaint each call, which at this rate was a
            # sixth of a core the app never spends in a terminal
            while feed.builder.finished < n_reqs:
                await asyncio.sleep(WATCH_INTERVAL)
                if feed.error:
                    raise RuntimeError(feed.error)
            cpu.extend((time.process_time(), time.monotonic()))
            await pilot.press("q")

    try:
        asyncio.run(run())
    finally:
        conn.close()
    busy = [e for e in iterations if e.bid or e.processed_bid]
    start, end = busy[0].started, busy[-1].ts
    tokens = sum(r.tokens_at(10**9) for r in feed.builder.requests.values())
    updates = sum(1 for t in drawn if start <= t <= end)
    c0, w0, c1, w1 = cpu
    frames = sum(1 for t in drawn if w0 <= t <= w1)
    return Run(end - start, tokens, len(busy), updates, end - start, (c1 - c0) / (w1 - w0),
               1000 * (c1 - c0) / max(frames, 1))


def _child(fn, args: tuple, out) -> None:  # noqa: ANN001
    try:
        out.put(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put(("error", traceback.format_exc()))


def in_own_process(fn, *args):  # noqa: ANN001, ANN201
    """``fn(*args)`` in a new process (one that may start processes of its own, which a
    Pool's worker may not)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, out))
    proc.start()
    try:
        while True:
            try:
                kind, value = out.get(timeout=1.0)
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"the benchmark's process exited (code {proc.exitcode})") from None
    finally:
        proc.join(timeout=30)
    if kind == "error":
        raise RuntimeError(value)
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="pool-pressure", choices=BUILTIN)
    ap.add_argument("--repeat", type=int, default=1, help="submit the workload this many times (default 1)")
    ap.add_argument("--every", type=int, default=100, help="iterations between copies with --repeat (default 100)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; medians compared")
    args = ap.parse_args()
    if args.repeat < 1 or args.every < 0:
        ap.error("--repeat must be >= 1 and --every >= 0")
    workload = repeated(args.workload, args.repeat, args.every)
    import torch

    threads = {"alone": torch.get_num_threads(), "tui": engine_threads()}
    sides = ["alone", "alone-tui-threads", "tui"] if threads["tui"] != threads["alone"] else ["alone", "tui"]
    runs: dict[str, list[Run]] = {side: [] for side in sides}
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a process of its own, like the TUI's engine
        for i in range(args.repeats):
            for side in sides if i % 2 == 0 else sides[::-1]:
                print(f"[{i + 1}/{args.repeats}] {side} ...", file=sys.stderr, flush=True)
                if side == "tui":
                    runs[side].append(in_own_process(with_tui, args.model, workload))
                else:
                    n = threads["alone"] if side == "alone" else threads["tui"]
                    runs[side].append(pool.apply(without_tui, (args.model, workload, n)))
    med = {side: statistics.median(r.tok_s for r in rs) for side, rs in runs.items()}
    ratio = med["tui"] / med["alone"]
    shown = runs["tui"]
    ups = statistics.median(r.updates / r.updates_seconds for r in shown)
    its = statistics.median(r.iterations / r.seconds for r in shown)
    need = min(10.0, its)

    def threads_label(n: int) -> str:
        return f"{n} thread{'s' if n > 1 else ''}"

    names = {"alone": f"engine alone, {threads_label(threads['alone'])}",
             "alone-tui-threads": f"engine alone, {threads_label(threads['tui'])}",
             "tui": f"engine + TUI, {threads_label(threads['tui'])}"}
    width = max(18, 8 * args.repeats + 2)
    print(f"model {args.model}, workload {workload.name}, median of {args.repeats}")
    print(f"{'':<26}{'tok/s (each run)':>{width}}{'median':>9}")
    for side in sides:
        print(f"{names[side]:<26}{'  '.join(f'{r.tok_s:6.1f}' for r in runs[side]):>{width}}{med[side]:>9.1f}")
    print(f"ratio {ratio:.3f} (goal >= 0.90: {'met' if ratio >= 0.9 else 'NOT met'})")
    if "alone-tui-threads" in med:
        print(f"  = the core left to the screen {med['alone-tui-threads'] / med['alone']:.3f}"
              f" x the screen itself {med['tui'] / med['alone-tui-threads']:.3f}")
    print(f"engine {its:.1f} iterations/s; screen {ups:.1f} updates/s "
          f"(goal >= {need:.1f}: {'met' if ups >= 0.95 * need else 'NOT met'})")
    print(f"the screen's process: {statistics.median(r.screen_ms_per_update for r in shown):.1f} ms of CPU per update, "
          f"{statistics.median(r.screen_cpu for r in shown):.0%} of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
