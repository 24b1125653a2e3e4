"""benchmarks/overlap.py end to end on tiny-random, small: both loops run, the headline
ratio is the median of the pairs' ratios, and the time breakdown adds up."""

import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_overlap_benchmark_prints_pairs_their_median_and_the_breakdown():
    out = subprocess.run([sys.executable, "benchmarks/overlap.py", "--requests", "8", "--new-tokens", "16",
                          "--repeats", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    pairs = [float(x) for x in re.search(r"^ratio per pair: (.+)$", text, re.M)[1].split()]
    ratio = float(re.search(r"median of pairs ([\d.]+) \(goal >= 1.1: (met|NOT met)\)", text)[1])
    assert len(pairs) == 3 and abs(ratio - statistics.median(pairs)) < 0.006
    rows = {m[0]: [float(x) for x in m[1:]] for m in
            re.findall(r"^(normal|overlap)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                       text, re.M)}
    assert set(rows) == {"normal", "overlap"}
    plan, launch, wait, process, forward, sched, hidden = rows["normal"]
    assert wait == 0 and hidden == 0 and abs(sched - (plan + process)) <= 0.016  # printed to 0.01
    plan, launch, wait, process, forward, sched, hidden = rows["overlap"]
    assert abs(sched - (plan + launch + process)) <= 0.021 and 0 <= hidden <= sched + 0.006
