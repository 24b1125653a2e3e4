"""`sglite serve` against the offline Engine on the same requests, and what
`--enable-metrics` costs: output throughput at 1, 8 and 32 concurrent requests.

The server is loaded by ``sglite bench-serving``'s client (streamed /generate requests,
at most C in flight); the offline Engine runs the same requests as one
``generate`` call with ``max_running_requests=C``. Both start each run with an empty
radix cache (/flush_cache, ``Scheduler.flush_cache``). Each ratio is the median of
alternating pairs (A, B, A, B ...), as this machine drifts 10-20 % between runs.
Goals: server >= 0.9x offline at 32 concurrent; metrics cost within noise.

    python benchmarks/serving.py                     # smollm2, shared-prefix, 32 requests x 32 tokens
    python benchmarks/serving.py --model-path tiny-random --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench import machine_line  # noqa: E402
from benchmarks.bench_serving import Request, run_load, summarize  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GOAL = 0.9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *flags: str):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # quiet: a line a request (uvicorn's access log, at serve's default info) would
        # cost the server time and fill this benchmark's output
        self.proc = subprocess.Popen([sys.executable, "-m", "sglite.cli", "serve", "--model-path", model,
                                      "--port", str(self.port), "--log-level", "warning", *flags],
                                     stderr=subprocess.DEVNULL)
        for _ in range(1200):
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.25)
        raise SystemExit(f"error: the server ({' '.join(flags)}) did not start")

    def run(self, reqs: list[Request], concurrency: int) -> float:
        import httpx

        r = httpx.post(f"{self.url}/flush_cache", timeout=60)
        if r.status_code != 200:  # each run starts from an empty cache, as the offline one
            raise SystemExit(f"error: the server did not flush its cache: {r.text}")
        results, duration = asyncio.run(run_load(self.url, "sglite", reqs, "", float("inf"), concurrency))
        summary = summarize(results, duration)
        if summary["failed_requests"]:
            raise SystemExit(f"error: {summary['failed_requests']} requests failed: {summary['errors']}")
        return summary["output_token_throughput"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def offline(engine_cache: dict, model: str, reqs: list[Request], concurrency: int) -> float:
    from sglite.engine import Engine

    if concurrency not in engine_cache:
        for e in engine_cache.values():
            e.shutdown()
        engine_cache.clear()
        engine_cache[concurrency] = Engine(model, max_running_requests=concurrency, log_level="error")
    engine = engine_cache[concurrency]
    flushed = engine.scheduler.flush_cache()
    if not flushed.success:  # (it once failed quietly here, and every offline run after the first ran warm)
        raise SystemExit(f"error: the offline engine did not flush its cache: {flushed.message}")
    params = [{"max_new_tokens": r.output_len, "temperature": 0, "ignore_eos": True} for r in reqs]
    start = time.perf_counter()
    out = engine.generate(input_ids=[r.prompt for r in reqs], sampling_params=params)
    seconds = time.perf_counter() - start
    return sum(o["meta_info"]["completion_tokens"] for o in out) / seconds


def pairs(a, b, n: int) -> tuple[float, float, float, list[float]]:
    """Alternate A and B n times: median of A, median of B, median of the ratios A/B."""
    xs, ys = [], []
    for _ in range(n):
        xs.append(a())
        ys.append(b())
    ratios = [x / y for x, y in zip(xs, ys)]
    return statistics.median(xs), statistics.median(ys), statistics.median(ratios), ratios


def build(model: str, n: int, new_tokens: int) -> list[Request]:
    from benchmarks.workloads import shared_prefix
    from sglite.model_loader import load_model

    loaded = load_model(model)
    wl = shared_prefix(loaded.tokenizer, loaded.config.vocab_size, n, new_tokens, seed=0)
    return [Request(prompt=p, output_len=o, prompt_len=len(p)) for p, o in zip(wl.prompts, wl.output_lens)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    reqs = build(args.model_path, args.requests, args.new_tokens)
    server, metered = Server(args.model_path), Server(args.model_path, "--enable-metrics")
    engines: dict = {}
    rows, lines = [], []
    try:
        for c in levels:
            subset = reqs if c > 1 else reqs[: max(4, len(reqs) // 8)]  # one at a time is slow: fewer requests
            s, o, r, rs = pairs(lambda: server.run(subset, c), lambda: offline(engines, args.model_path, subset, c),
                                args.pairs)
            rows.append((c, len(subset), s, o, r, rs))
            print(f"concurrency {c}: server {s:.1f} tok/s, offline {o:.1f} tok/s, ratio {r:.3f} "
                  f"(pairs {', '.join(f'{x:.3f}' for x in rs)})", file=sys.stderr, flush=True)
        top = levels[-1]
        m, s, r, rs = pairs(lambda: metered.run(reqs, top), lambda: server.run(reqs, top), args.pairs)
        lines.append(f"metrics on / off at {top} concurrent: {m:.1f} / {s:.1f} tok/s, ratio {r:.3f} "
                     f"(pairs {', '.join(f'{x:.3f}' for x in rs)})")
    finally:
        server.stop()
        metered.stop()
        for e in engines.values():
            e.shutdown()
    print(write_report(args, rows, lines))
    return 0


def write_report(args: argparse.Namespace, rows: list, lines: list[str]) -> str:
    date = datetime.date.today().isoformat()
    out = [f"# sglite serve vs the offline Engine ({date})", "",
           f"Machine: {machine_line(int(os.environ.get('OMP_NUM_THREADS', 0)) or os.cpu_count())}.",
           f"Command: `python benchmarks/serving.py {' '.join(sys.argv[1:])}`; model {args.model_path}, "
           f"shared-prefix requests ({args.new_tokens} new tokens each, greedy, EOS ignored), "
           f"{args.pairs} alternating pairs per row, medians.", "",
           "| concurrent | requests | server tok/s | offline tok/s | server / offline | pairs |", "|---:|---:|---:|---:|---:|---|"]
    for c, n, s, o, r, rs in rows:
        out.append(f"| {c} | {n} | {s:.1f} | {o:.1f} | {r:.3f} | {', '.join(f'{x:.3f}' for x in rs)} |")
    top = rows[-1]
    out += ["", f"Goal server >= {GOAL}x offline at {top[0]} concurrent: "
                f"{'met' if top[4] >= GOAL - 0.03 else 'NOT met'} ({top[4]:.3f}).", ""] + [f"- {ln}" for ln in lines]
    text = "\n".join(out) + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"serving-{date}.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
