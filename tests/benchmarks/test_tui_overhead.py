"""benchmarks/tui_overhead.py end to end on tiny-random: every side runs the whole
workload, and the printed ratio is the product of its two parts."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tui_overhead_prints_the_ratio_and_its_parts():
    out = subprocess.run([sys.executable, "benchmarks/tui_overhead.py", "--model", "tiny-random", "--repeats", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    medians = {name: float(v) for name, v in re.findall(r"^(engine [^\d]+\d+ threads?)\s+[\d.]+\s+([\d.]+)$",
                                                         text, re.M)}
    ratio = float(re.search(r"^ratio ([\d.]+) \(goal >= 0.90: (met|NOT met)\)$", text, re.M).group(1))
    alone = next(v for k, v in medians.items() if k.startswith("engine alone"))
    tui = next(v for k, v in medians.items() if k.startswith("engine + TUI"))
    assert abs(ratio - tui / alone) < 2e-3
    parts = re.search(r"= the core left to the screen ([\d.]+) x the screen itself ([\d.]+)$", text, re.M)
    if parts:  # more than one core: the TUI's engine runs on one thread fewer
        assert len(medians) == 3 and abs(float(parts[1]) * float(parts[2]) - ratio) < 5e-3
    assert re.search(r"screen [\d.]+ updates/s \(goal >= [\d.]+: (met|NOT met)\)", text)
    cpu = re.search(r"^the screen's process: ([\d.]+) ms of CPU per update, (\d+)% of a core$", text, re.M)
    assert cpu and float(cpu[1]) > 0 and 0 < int(cpu[2]) <= 100
