"""--tp-size 1 against --tp-size 2 on this machine: the same workloads in alternating
pairs (tp 1, tp 2, tp 1, ...), each engine in a process of its own that loads once.

Two workloads: a batch (N requests at once, output tokens a second) and one chat
(one request alone, milliseconds per output token). For tp 2 it also prints where a
decode forward's time goes on each rank: its forward, and the all-reduces and the
all-gather inside it (ForwardFinished.tp_timings).

On a 2-core CPU tp 2 gives each rank one core: the same arithmetic as tp 1's two
threads, plus 2 all-reduces a layer through gloo, so expect a slowdown; the point of
the numbers is what the communication costs, not a speedup. On a machine with several
GPUs the same script runs NCCL.

    python benchmarks/tensor_parallel.py                                  # smollm2-135m, 5 pairs
    python benchmarks/tensor_parallel.py --model tiny-random --pairs 3 --requests 8 --new-tokens 16
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench import machine_line  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(32, 96))] for _ in range(n)]


def _engine_process(conn: Any, kwargs: dict[str, Any]) -> None:
    """Load one engine, then run what the parent asks until it sends None."""
    from sglite import events as ev
    from sglite.engine import Engine

    with Engine(**kwargs) as engine:
        timings: list[tuple] = []
        engine.event_bus.subscribe(lambda e: timings.append(e.tp_timings)
                                   if isinstance(e, ev.ForwardFinished) and e.forward_mode == "DECODE" else None)
        conn.send(engine.scheduler.model_config.vocab_size)
        while (job := conn.recv()) is not None:
            timings.clear()
            conn.send((_run(engine, *job), list(timings)))


def _run(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens a second (a batch) or seconds per output token (one prompt)."""
    import time

    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    tic = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - tic
    tokens = sum(len(o["output_ids"]) for o in outs)
    return tokens / elapsed if len(prompts) > 1 else elapsed / tokens


class EngineProcess:
    def __init__(self, **kwargs: Any):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # not a daemon: a tp 2 engine starts its rank 1 as a child of its own
        self.proc = ctx.Process(target=_engine_process, args=(child, kwargs), daemon=False)
        self.proc.start()
        self.vocab = self.conn.recv()

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[tuple]]:
        self.conn.send((prompts, new_tokens))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def _collectives_worker(rank: int, addr: str, out: Any) -> None:
    """Both paths of one GroupCoordinator: shared memory, then gloo (shm set aside)."""
    import time

    import torch

    from sglite.distributed.parallel_state import destroy_model_parallel, init_distributed_environment
    from sglite.model_executor.model_runner import split_cpu_threads

    split_cpu_threads(rank, 2)
    group = init_distributed_environment(2, rank, f"tcp://{addr}", "cpu")
    shm, result = group.shm, {}
    for path in ("shared memory", "gloo"):
        group.shm = shm if path == "shared memory" else None
        for rows in (1, 16):
            t = torch.randn(rows, 576)
            for _ in range(20):
                group.all_reduce(t)
            start, n = time.perf_counter(), 300
            for _ in range(n):
                group.all_reduce(t)
            result[(path, rows)] = (time.perf_counter() - start) / n * 1e6
    destroy_model_parallel()
    if rank == 0:
        out.put(result)


def collective_latency() -> dict[tuple[str, int], float]:
    """Microseconds per all-reduce of [rows, 576] (SmolLM2's hidden size) between two
    processes on this machine, each pinned to its own cores, as tp 2's ranks are."""
    from sglite.managers.tp_worker import set_dist_init_addr
    from sglite.server_args import ServerArgs

    args = ServerArgs(tp_size=2)
    set_dist_init_addr(args)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collectives_worker, args=(r, args.dist_init_addr, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(30)
    return result


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def split_line(timings: list[tuple]) -> list[str]:
    """Median over the decode forwards, per rank: forward ms, collectives ms, their share."""
    lines = []
    for rank in range(len(timings[0]) if timings else 0):
        fwd = statistics.median(t[rank][0] for t in timings) * 1e3
        comm = statistics.median(t[rank][1] for t in timings) * 1e3
        lines.append(f"TP{rank}: forward {fwd:.2f} ms, all-reduce + all-gather {comm:.2f} ms ({comm / fwd:.0%})")
    return lines


def measure(args: argparse.Namespace) -> dict[str, Any]:
    common = {"model_path": args.model, "dtype": args.dtype, "log_level": "error", "max_total_tokens": 16384}
    # "1g": tp 1 without the CPU graph, which tp 2 cannot use (it has no all-reduce between
    # layers): what of tp 2's cost is the module-by-module forward, not the communication
    engines = {1: EngineProcess(tp_size=1, **common), 2: EngineProcess(tp_size=2, **common),
               "1g": EngineProcess(tp_size=1, disable_cpu_graph=True, **common)}
    prompts = workload(args.requests, engines[1].vocab)
    got: dict[str, dict[Any, list[float]]] = {name: {tp: [] for tp in engines} for name in ("batch", "one")}
    split: dict[str, list[tuple]] = {"batch": [], "one": []}
    try:
        for tp in engines:  # warm-up: first forwards allocate and compile
            engines[tp].run(prompts[:2], 4)
        for i in range(args.pairs):
            for tp in engines:
                for name, job in (("batch", (prompts, args.new_tokens)), ("one", (prompts[:1], args.new_tokens))):
                    value, timings = engines[tp].run(*job)
                    got[name][tp].append(value)
                    if tp == 2:
                        split[name] += timings
            print(f"pair {i + 1}/{args.pairs}: batch {got['batch'][1][-1]:.1f} vs {got['batch'][2][-1]:.1f} tok/s",
                  file=sys.stderr, flush=True)
    finally:
        for e in engines.values():
            e.close()
    return {"got": got, "split": split, "collectives": collective_latency()}


def _row(label: str, base: list[float], tp2: list[float], per_token: bool) -> str:
    """One table row: medians, tp 2's speed relative to the base per pair, their median
    (per_token: the values are seconds a token, shown in ms; speed = base / tp 2)."""
    ratios = [a / b if per_token else b / a for a, b in zip(base, tp2)]
    scale, fmt = (1e3, ".2f") if per_token else (1.0, ".1f")
    return (f"| {label} | {statistics.median(base) * scale:{fmt}} | {statistics.median(tp2) * scale:{fmt}} | "
            f"{' '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f}x |")


def report(args: argparse.Namespace, m: dict[str, Any]) -> str:
    got = m["got"]
    lines = [f"# tensor parallel: --tp-size 1 vs 2, {datetime.date.today()}", "",
             f"machine: {machine_line(torch_threads())}",
             f"model {args.model}, dtype {args.dtype}; {args.pairs} alternating rounds (tp 1, tp 2, tp 1 without "
             f"the CPU graph); batch: {args.requests} requests x {args.new_tokens} new tokens at once; one chat: "
             f"1 request x {args.new_tokens} tokens", "",
             "| workload | tp 1 (median) | tp 2 (median) | tp 2's speed / tp 1's, per pair | median ratio |",
             "|---|---|---|---|---|",
             _row("batch, output tok/s", got["batch"][1], got["batch"][2], False),
             _row("one chat, ms/token", got["one"][1], got["one"][2], True),
             _row("batch, output tok/s, tp 1 without the CPU graph", got["batch"]["1g"], got["batch"][2], False),
             _row("one chat, ms/token, tp 1 without the CPU graph", got["one"]["1g"], got["one"][2], True), "",
             "tp 2 cannot run the CPU graph (one C++ call for the whole decode forward, no all-reduce between layers), "
             "so the last two rows compare it with tp 1 run module by module too.", "",
             "tp 2, a decode forward (median over forwards):"]
    for name in ("batch", "one"):
        lines += [f"- {name}: " + "; ".join(split_line(m["split"][name]))]
    lat = m["collectives"]
    lines += ["", "One all-reduce of [rows, 576] floats between two pinned processes, microseconds:", "",
              "| path | 1 row | 16 rows |", "|---|---|---|"]
    lines += [f"| {path} | {lat[(path, 1)]:.0f} | {lat[(path, 16)]:.0f} |" for path in ("shared memory", "gloo")]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the report here too (markdown)")
    args = p.parse_args()
    text = report(args, measure(args))
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
