"""benchmarks/cpu_attention.py prints one row per batch size, both backends agreeing."""

from __future__ import annotations

import re

import pytest

from benchmarks import cpu_attention


def test_prints_a_row_per_batch_size_with_the_backends_agreeing(capsys):
    assert cpu_attention.main(["--batch-sizes", "1,3", "--iters", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if re.match(r"\| \d+ \|", ln)]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[4].endswith("×") and float(cells[5]) < 1e-4  # max abs diff between the backends


def test_bad_batch_sizes_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cpu_attention.main(["--batch-sizes", "0,x"])
    assert e.value.code == 2 and "--batch-sizes takes positive integers" in capsys.readouterr().err


def test_shared_prefix_rows_agree_and_torch_native_attends_the_prefix_once(capsys, monkeypatch):
    from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend

    grouped = []
    plan = TorchNativeAttnBackend.init_forward_metadata

    def spy(self, fb):  # noqa: ANN001
        plan(self, fb)
        grouped.append((self.name, len(self._groups)))

    monkeypatch.setattr(TorchNativeAttnBackend, "init_forward_metadata", spy)
    assert cpu_attention.main(["--batch-sizes", "4", "--iters", "1", "--rounds", "1", "--shared-prefix", "300"]) == 0
    out = capsys.readouterr().out
    assert "the first 300 shared by every request" in out
    (row,) = [ln for ln in out.splitlines() if re.match(r"\| 4 \|", ln)]
    assert float(row.strip("|").split("|")[5]) < 1e-4
    # the cascade against the kernel: the cpu backend plans every row for its kernel (its
    # own init_forward_metadata: no groups), torch_native attends the prefix once
    assert set(grouped) == {("torch_native", 1)}
