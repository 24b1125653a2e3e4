"""benchmarks/tensor_parallel.py end to end on tiny-random, small: both engines run in
alternating pairs, the headline ratio is the median of the pairs', and tp 2's split
names both ranks with their collectives' share."""

import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tp_benchmark_prints_pairs_their_median_and_each_rank_s_split(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/tensor_parallel.py", "--model", "tiny-random", "--pairs", "3",
                          "--requests", "4", "--new-tokens", "8", "--out", str(tmp_path / "tp.md")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "machine: " in text and ("avx512_bf16" in text or "no avx512_bf16" in text)
    row = re.search(r"^\| batch, output tok/s \| ([\d.]+) \| ([\d.]+) \| ([\d. ]+) \| ([\d.]+)x \|$", text, re.M)
    pairs = [float(x) for x in row[3].split()]
    assert len(pairs) == 3 and abs(float(row[4]) - statistics.median(pairs)) < 0.006
    assert len(re.findall(r"^\| (batch|one chat), .+, tp 1 without the CPU graph \| [\d.]+ \| [\d.]+ \|", text, re.M)) == 2
    for name in ("batch", "one"):
        line = re.search(rf"^- {name}: (.+)$", text, re.M)[1]
        assert re.fullmatch(r"TP0: forward [\d.]+ ms, all-reduce \+ all-gather [\d.]+ ms \(\d+%\); "
                            r"TP1: forward [\d.]+ ms, all-reduce \+ all-gather [\d.]+ ms \(\d+%\)", line), line
    lat = dict(re.findall(r"^\| (shared memory|gloo) \| (\d+) \| \d+ \|$", text, re.M))
    assert set(lat) == {"shared memory", "gloo"}
    assert (tmp_path / "tp.md").read_text() == text.rstrip("\n") + "\n"
