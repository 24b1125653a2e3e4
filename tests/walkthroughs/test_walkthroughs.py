"""Every walkthrough runs in both languages, its checks hold, and its diagrams are
produced (rendered to SVG where graphviz's dot is installed, as .ci/run ensures)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys

import pytest

from walkthroughs import Narrator, WalkthroughFailed, registry

NAMES = list(registry())
REAL_MODEL = {"batch-invariance", "constrained-decoding"}  # on SmolLM2 (the weights' arithmetic; real JSON)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.real_model) if n in REAL_MODEL else n
                                  for n in NAMES])
def test_walkthrough_runs_and_checks_in_both_languages(name, tmp_path):
    """One run told in English and, through the mirror, in Chinese: the walkthroughs never
    read their narrator's language, so this is what two runs would print."""
    en, zh = io.StringIO(), io.StringIO()
    n = Narrator(lang="en", out_dir=tmp_path, stream=en, mirror=Narrator(lang="zh", stream=zh))
    registry()[name].run(n)
    assert len(n.checks) >= 3 and len(n.mirror.checks) == len(n.checks)
    assert n.diagrams and all(p.exists() for p in n.diagrams)
    if shutil.which("dot"):
        assert any(p.suffix == ".svg" and p.read_text().lstrip().startswith("<?xml") for p in n.diagrams)
    assert "✓" in en.getvalue() and "✓" in zh.getvalue()
    assert any("\u4e00" <= ch <= "\u9fff" for ch in zh.getvalue())
    assert not any("\u4e00" <= ch <= "\u9fff" for ch in en.getvalue())


def test_a_wrong_number_fails_loudly():
    n = Narrator(stream=io.StringIO())
    with pytest.raises(WalkthroughFailed, match="expected 9, the engine gave 8"):
        n.check(8, 9, "rows", "行数")


def test_cli_list_and_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "walkthrough", "list"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.splitlines()] == NAMES
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "walkthrough", "two-requests", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "13 checks passed" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "walkthrough", "two-requests", "--lang", "zh", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "13 项检查全部通过" in proc.stdout and "checks passed" not in proc.stdout
    assert "diagram:" not in proc.stdout and "图: " in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "walkthrough", "nope"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "known:" in proc.stderr
