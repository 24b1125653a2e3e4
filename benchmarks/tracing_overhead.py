"""Engine throughput with tracing off, at levels 1, 2, 3, and with an unreachable OTLP
collector, as ratios to off, in one run. Spans go through the SDK's batch processor
to a JSON-lines file (levels 1-3) or to a closed local port (unreachable).

Goals: >= 0.95 at level 2; >= 0.98 with an unreachable collector at level 1.

    python benchmarks/tracing_overhead.py                 # smollm2-135m, 32 requests
    python benchmarks/tracing_overhead.py --model tiny-random --requests 64
"""

from __future__ import annotations

import argparse
import logging
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglite.engine import Engine  # noqa: E402
from tracing import setup_tracing  # noqa: E402
from tracing.otel import JsonlSpanExporter, otlp_exporter  # noqa: E402


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(40)]
    return [system + [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 48))] for _ in range(n)]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    tic = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - tic
    return sum(len(o["output_ids"]) for o in outs) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.getLogger("sglite.tracing").setLevel(logging.ERROR)

    engine = Engine(args.model, max_total_tokens=16384, log_level="error")
    prompts = workload(args.requests, engine.scheduler.model_config.vocab_size)
    run(engine, prompts[:4], 4)  # warm up
    tmp = Path(tempfile.mkdtemp(prefix="sglite-trace-bench-"))
    configs = [("off", 0, None), ("level 1", 1, "jsonl"), ("level 2", 2, "jsonl"), ("level 3", 3, "jsonl"),
               ("unreachable, level 1", 1, "unreachable")]
    results: dict[str, float] = {}
    for rep in range(args.repeats):
        for name, level, sink in configs:
            engine.scheduler.tree_cache.reset()  # the same cache state for every config
            engine.scheduler.token_to_kv_pool_allocator.clear()
            tr = None
            if level:
                exporter = (JsonlSpanExporter(str(tmp / f"{level}-{rep}.jsonl")) if sink == "jsonl"
                            else otlp_exporter(f"127.0.0.1:{closed_port()}", protocol="http/protobuf", timeout=0.5))
                tr = setup_tracing(engine.event_bus, level, exporters=[exporter])
            tput = run(engine, prompts, args.new_tokens)
            if tr is not None:
                tr.shutdown()
            results[name] = max(results.get(name, 0.0), tput)
            print(f"  repeat {rep + 1}/{args.repeats} {name:<22} {tput:8.1f} tok/s", file=sys.stderr)
    base = results["off"]
    goals = {"level 2": 0.95, "unreachable, level 1": 0.98}
    print(f"model {args.model}, {args.requests} requests x {args.new_tokens} new tokens, best of {args.repeats}")
    print(f"{'tracing':<24}{'output tok/s':>14}{'ratio to off':>14}  goal")
    for name, _, _ in configs:
        ratio = results[name] / base
        goal = goals.get(name)
        mark = "" if goal is None else f">= {goal:.2f} {'met' if ratio >= goal else 'NOT met'}"
        print(f"{name:<24}{results[name]:>14.1f}{ratio:>14.3f}  {mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
