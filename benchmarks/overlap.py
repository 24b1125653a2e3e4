"""The overlap loop against the normal loop, on the same decode-heavy workload, in one
run: output throughput of each and their ratio, and where the scheduler's time went
(planning, launching, waiting for the forward, processing results) with how much of it
ran while a forward was running, i.e. was hidden.

The tiny model makes scheduling a large share of each round, which is where the overlap
loop pays off. The two loops run in alternating pairs; the ratio is the median of the
pairs' ratios (a run lasts about a second, and this kind of VM drifts by 10-30 % between
runs). Goal: >= 1.1x.

    python benchmarks/overlap.py                       # tiny-random, 64 requests x 128 tokens
    python benchmarks/overlap.py --model smollm2-135m --requests 16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglite import events as ev  # noqa: E402
from sglite.engine import Engine  # noqa: E402
from tracing.phases import SchedulerTime, scheduler_time  # noqa: E402

GOAL = 1.1


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 48))] for _ in range(n)]


def make_engine(model: str, overlap: bool) -> Engine:
    return Engine(model, disable_overlap_schedule=not overlap, max_running_requests=256, log_level="error")


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    tic = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - tic
    while engine.scheduler.has_work():  # the overlap loop's last extra round
        engine.step()
    return sum(len(o["output_ids"]) for o in outs) / elapsed


def breakdown(model: str, overlap: bool, prompts: list[list[int]], new_tokens: int) -> SchedulerTime:
    """One instrumented run: seconds per phase, summed over iterations."""
    engine = make_engine(model, overlap)
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    run(engine, prompts, new_tokens)
    return scheduler_time(log.events)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="runs of each loop, alternating (default 5)")
    args = ap.parse_args()
    logging.getLogger("sglite").setLevel(logging.ERROR)

    engines = {ov: make_engine(args.model, ov) for ov in (False, True)}
    prompts = workload(args.requests, engines[False].scheduler.model_config.vocab_size)
    for engine in engines.values():  # warm up (first-call allocations, kernels)
        run(engine, prompts[:4], 4)
    engines[False].freeze_gc()  # both engines' objects: full GC passes stalled either loop at random
    runs: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeats):
        for ov in (False, True) if i % 2 == 0 else (True, False):
            runs[ov].append(run(engines[ov], prompts, args.new_tokens))
        print(f"  pair {i + 1}/{args.repeats}: normal {runs[False][-1]:9.1f}, overlap {runs[True][-1]:9.1f} tok/s",
              file=sys.stderr)
    for engine in engines.values():
        engine.shutdown()  # and back to the garbage collector
    # each pair ran minutes apart from the others at most: its ratio is the least drifting
    # measure; the headline is their median
    pairs = [o / n for n, o in zip(runs[False], runs[True])]
    ratio = statistics.median(pairs)
    import torch

    print(f"model {args.model}, {args.requests} requests x {args.new_tokens} new tokens, greedy, "
          f"{args.repeats} alternating pairs, torch threads {torch.get_num_threads()}")
    print(f"{'loop':<10}{'median tok/s':>14}{'best tok/s':>12}")
    for ov, name in ((False, "normal"), (True, "overlap")):
        print(f"{name:<10}{statistics.median(runs[ov]):>14.1f}{max(runs[ov]):>12.1f}")
    print(f"ratio per pair: {' '.join(f'{r:.2f}' for r in pairs)}")
    print(f"ratio overlap / normal, median of pairs {ratio:.3f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})")
    print()
    print("where the scheduler's time went (one instrumented run each, seconds):")
    print(f"{'loop':<10}{'plan':>8}{'launch':>8}{'wait':>8}{'process':>9}{'forward':>9}{'sched':>8}{'hidden':>8}")
    for ov in (False, True):
        b = breakdown(args.model, ov, prompts, args.new_tokens)
        name = "overlap" if ov else "normal"
        print(f"{name:<10}{b.plan:>8.2f}{b.launch:>8.2f}{b.wait:>8.2f}{b.process:>9.2f}"
              f"{b.forward:>9.2f}{b.busy:>8.2f}{b.hidden:>8.2f}")
        if ov:
            print(f"overlap: {b.hidden_fraction:.0%} of the scheduler's own work ran while a forward was running")
    print("(normal: 'launch' is the forward itself, run inline; overlap: 'wait' is the scheduler idle until the "
          "forward it needs is done)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
