"""What one client's oversized body costs everyone else: `/health` latency on
`sglite serve` while another client sends a body that must be refused (the goal: < 100
ms, docs/serving.md "Limits"). /health runs SGLang's one-token probe, so its idle
latency is one tiny forward.

Each case sends its body 5 times, from a process at nice 19 (a client on another
machine would not share the server's two cores); a thread polls /health every 20 ms
meanwhile. Printed: the body's answer, how long it took, and /health's median and worst
latency during it, beside the same poll with nothing else running.

    python benchmarks/server_guard.py                       # smollm2 (its real tokenizer)
    python benchmarks/server_guard.py --model-path tiny-random
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench import machine_line  # noqa: E402
from benchmarks.serving import RESULTS, Server  # noqa: E402

GOAL_MS = 100.0
REPEAT = 5


def cases() -> list[tuple[str, str, bytes]]:
    """(name, route, body): each one the server must refuse without stalling others."""
    return [
        ("25 MB text prompt", "/v1/completions", json.dumps({"prompt": "word " * 5_000_000, "max_tokens": 1}).encode()),
        ("10 MB chat message", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": "hi " * 3_400_000}], "max_tokens": 1}).encode()),
        ("600 KB prompt (tokenized, then too long)", "/generate", json.dumps({"text": "word " * 120_000}).encode()),
        ("30 MB of token ids", "/generate", json.dumps({"input_ids": list(range(5)) * 1_500_000}).encode()),
        ("fan-out: 1,000 prompts x n=16", "/v1/completions",
         json.dumps({"prompt": ["a"] * 1000, "n": 16, "max_tokens": 1}).encode()),
        ("40 MB body (over --max-body-size)", "/generate", b'{"text": "' + b"x" * 40_000_000 + b'"}'),
    ]


def poll_health(url: str, stop: threading.Event, out: list[float]) -> None:
    import httpx

    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            tic = time.perf_counter()
            c.get(f"{url}/health")
            out.append((time.perf_counter() - tic) * 1000)
            time.sleep(0.02)


_BODIES: dict[int, tuple[str, bytes]] = {}  # the sender process's: each case's body, built once


def send(url: str, case: int) -> tuple[str, float]:
    """(the answer's status and head, seconds the POST took), in the sender process."""
    import httpx

    if case not in _BODIES:
        _BODIES[case] = cases()[case][1:]
    route, body = _BODIES[case]
    tic = time.perf_counter()
    r = httpx.post(f"{url}{route}", content=body, headers={"content-type": "application/json"}, timeout=300)
    return f"{r.status_code} {r.text[:90]}", time.perf_counter() - tic


def measure(url: str, sender: ProcessPoolExecutor, case: int | None) -> tuple[list[float], str, float]:
    """(/health latencies in ms, the body's status and message head, its seconds)."""
    if case is not None:
        sender.submit(send, url, case).result()  # (builds the body in the sender; not timed)
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=poll_health, args=(url, stop, latencies))
    poller.start()
    time.sleep(0.3)
    if case is None:
        answer, seconds = "-", 1.0
        time.sleep(1.0)
    else:
        answer, seconds = sender.submit(send, url, case).result()
    time.sleep(0.3)
    stop.set()
    poller.join()
    return latencies, answer, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m")
    args = p.parse_args()
    server = Server(args.model_path)
    lines = [f"# /health under oversized bodies ({datetime.date.today()})", "", machine_line(2), "",
             f"model {args.model_path}; each case {REPEAT} times, sent at nice 19; /health polled every 20 ms; goal: worst < "
             f"{GOAL_MS:.0f} ms", "", "| case | answer | body took (s, median) | /health median ms | /health worst ms |",
             "|---|---|---|---|---|"]
    sender = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=os.nice, initargs=(19,))
    names = [(None, "nothing else (baseline)")] + [(i, c[0]) for i, c in enumerate(cases())]
    try:
        for case, name in names:
            runs = [measure(server.url, sender, case) for _ in range(REPEAT)]
            lat = [x for r in runs for x in r[0]]
            row = (f"| {name} | {runs[-1][1].replace('|', '/')} | {statistics.median(r[2] for r in runs):.2f} | "
                   f"{statistics.median(lat):.1f} | {max(lat):.1f} |")
            print(row, flush=True)
            lines.append(row)
    finally:
        sender.shutdown()
        server.stop()
    out = RESULTS / f"server-guard-{datetime.date.today()}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
