"""Engine throughput with and without the TUI attached (headless Textual), and the
screen updates per second. Goals: ratio >= 0.9, >= 10 updates/s.

    python benchmarks/tui_overhead.py                      # smollm2-135m, pool-pressure
    python benchmarks/tui_overhead.py --model tiny-random
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglite.engine import Engine  # noqa: E402
from tui.app import EngineWorker, SchedulerApp  # noqa: E402
from tui.workloads import builtin  # noqa: E402


def make(model: str, workload: str):
    wl = builtin(workload)
    engine = Engine(model, log_level="error", **wl.server_args)
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})  # warm up
    return engine, wl


def without_tui(model: str, workload: str) -> tuple[float, int]:
    engine, wl = make(model, workload)
    worker = EngineWorker(engine, wl, lambda view: None)
    tic = time.perf_counter()
    while engine.scheduler.has_work() or worker.pending:
        worker.step()
    return time.perf_counter() - tic, worker.tokens


def with_tui(model: str, workload: str) -> tuple[float, int, int]:
    engine, wl = make(model, workload)
    app = SchedulerApp(engine, wl)

    async def run() -> float:
        async with app.run_test(size=(200, 50)) as pilot:
            tic = time.perf_counter()
            while engine.scheduler.has_work() or app.worker.pending or engine.scheduler.iteration == 0:
                await pilot.pause(0.02)
            return time.perf_counter() - tic

    elapsed = asyncio.run(run())
    return elapsed, app.worker.tokens, app.updates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="pool-pressure")
    args = ap.parse_args()
    t0, tok0 = without_tui(args.model, args.workload)
    t1, tok1, updates = with_tui(args.model, args.workload)
    base, ui = tok0 / t0, tok1 / t1
    ratio, ups = ui / base, updates / t1
    print(f"model {args.model}, workload {args.workload}")
    print(f"{'':<22}{'tok/s':>10}{'seconds':>10}")
    print(f"{'engine alone':<22}{base:>10.1f}{t0:>10.2f}")
    print(f"{'engine + TUI':<22}{ui:>10.1f}{t1:>10.2f}")
    print(f"ratio {ratio:.3f} (goal >= 0.90: {'met' if ratio >= 0.9 else 'NOT met'}); "
          f"{ups:.1f} screen updates/s (goal >= 10: {'met' if ups >= 10 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
