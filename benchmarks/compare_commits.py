"""What a change costs: `sglite bench` on a base commit and on this working tree, in
alternating pairs (base, here, base, here, ...: this machine drifts 10-20 % between
runs), printing each metric's median on both sides and the median of the per-pair
ratios, with their spread.

The base runs from a git worktree of BASE (made under /tmp, removed at the end) with
its own sglite on PYTHONPATH, in this same venv; each side builds its own CPU kernels
the first time.

    python benchmarks/compare_commits.py HEAD~1                       # shared-prefix + one-chat, 5 pairs
    python benchmarks/compare_commits.py 60c6213 --pairs 7 --workload shared-prefix
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (workload, row field, label, higher is better)
METRICS = [("shared-prefix", "output_tok_s", "shared-prefix output tok/s", True),
           ("shared-prefix", "itl_p50_ms", "shared-prefix ITL p50 ms", False),
           ("one-chat", "itl_p50_ms", "one-chat ITL p50 ms (batch-1 decode)", False),
           ("one-chat", "ttft_p50", "one-chat TTFT p50 s", False)]


def run_bench(tree: Path, workloads: list[str], out: Path) -> dict:
    """One `sglite bench` of ``tree``'s sglite; its JSON."""
    cmd = [sys.executable, "-m", "sglite.cli", "bench", "--peers", "none", "--ablations", "none", "--no-roofline",
           "--repeat", "1", "--out", str(out)] + [a for w in workloads for a in ("--workload", w)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    (path,) = out.glob("bench-*.json")
    data = json.loads(path.read_text())
    path.unlink()
    return data


def metric(data: dict, workload: str, field: str) -> float | None:
    rows = data["workloads"].get(workload, {}).get("rows", [])
    return rows[0][field] if rows and rows[0].get("ok") else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="the git revision to compare this working tree against")
    p.add_argument("--pairs", type=int, default=5, help="alternating pairs (default 5)")
    p.add_argument("--workload", action="append", choices=["shared-prefix", "one-chat"],
                   help="workloads (default: both)")
    args = p.parse_args(argv)
    workloads = args.workload or ["shared-prefix", "one-chat"]
    with tempfile.TemporaryDirectory(prefix="sglite-base-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"base": [], "here": []}
            for i in range(args.pairs):
                for side, tree in (("base", base), ("here", ROOT)):
                    runs[side].append(run_bench(tree, workloads, Path(tmp)))
                print(f"pair {i + 1}/{args.pairs} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    report(args.base, runs, workloads)
    return 0


def report(base: str, runs: dict[str, list[dict]], workloads: list[str]) -> None:
    print(f"{runs['here'][0]['machine']}\nbase {base} ({runs['base'][0]['commit']}) vs this tree "
          f"({runs['here'][0]['commit']}), {len(runs['here'])} alternating pairs\n")
    print("| metric | base (median) | here (median) | here / base: median of pairs | spread of the pairs |")
    print("|---|---:|---:|---:|---|")
    for workload, field, label, _ in METRICS:
        if workload not in workloads:
            continue
        pairs = [(metric(b, workload, field), metric(h, workload, field)) for b, h in zip(runs["base"], runs["here"])]
        pairs = [(b, h) for b, h in pairs if b is not None and h is not None]
        if not pairs:
            continue
        ratios = [h / b for b, h in pairs]
        print(f"| {label} | {statistics.median(b for b, _ in pairs):.3f} | {statistics.median(h for _, h in pairs):.3f}"
              f" | {statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")


if __name__ == "__main__":
    sys.exit(main())
