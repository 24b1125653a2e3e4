"""benchmarks/gpu.py's pure-Python parts on CPU: arguments, the peak-bandwidth lookup
and its override, the results table and file; and its refusal to run without CUDA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

GPU_PY = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("sglite_bench_gpu", GPU_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is executing
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_arguments(gpu):
    args = gpu.parse_args([])
    assert args.batch_sizes == [1, 32, 128] and args.peak_bandwidth_gbs is None and args.attn_context == 2048
    args = gpu.parse_args(["--peak-bandwidth-gbs", "3350", "--batch-sizes", "1,8", "--no-write"])
    assert args.peak_bandwidth_gbs == 3350.0 and args.batch_sizes == [1, 8] and args.no_write
    for bad in (["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--peak-bandwidth-gbs", "-1"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(bad)


@pytest.mark.parametrize("name,gbs", [
    ("NVIDIA H200", 4800.0), ("NVIDIA GH200 480GB", 4000.0), ("NVIDIA H20", 4000.0),
    ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA A100-SXM4-80GB", 2039.0),
    ("NVIDIA A100-SXM4-40GB", 1555.0), ("NVIDIA A10G", 600.0), ("NVIDIA L4", 300.0), ("NVIDIA L40S", 864.0),
])
def test_peak_bandwidth_by_device_name(gpu, name, gbs):
    assert gpu.peak_bandwidth_gbs(name)[0] == gbs


def test_peak_bandwidth_override_and_unknown_device(gpu):
    assert gpu.peak_bandwidth_gbs("NVIDIA H200", 1234.0) == (1234.0, "--peak-bandwidth-gbs")
    gbs, source = gpu.peak_bandwidth_gbs("Some Future GPU")
    assert gbs is None and "--peak-bandwidth-gbs" in source


def sample_report(gpu):
    r = gpu.Report(date="2026-12-02", device="NVIDIA H200", peak_gbs=4800.0, peak_source="datasheet value for H200")
    r.checks = [gpu.KernelCheck("decode attention", "q 32 / kv 8 heads, dim 64", "bfloat16", 4e-3, 0.25),
                gpu.KernelCheck("RoPE (neox)", "1 tokens", "float32", float("nan"), float("nan"))]
    r.token_checks = [("triton, CUDA graphs on vs off", True)]
    # 3.0 GB in 1000 us = 3000 GB/s = 62.5 % of 4800
    r.bandwidth = [gpu.BandwidthRow(128, 2048, 2, "contiguous", 1000.0, 3.0),
                   gpu.BandwidthRow(128, 2048, 16, "contiguous", 500.0, 3.0, default_splits=False)]
    r.throughput = [gpu.ThroughputRow(1, "triton", True, 2.0), gpu.ThroughputRow(1, "triton", False, 6.0),
                    gpu.ThroughputRow(1, "torch_native", True, None, "no CUDA-graph path")]
    return r


def test_markdown_table_and_goals(gpu):
    text = gpu.render_markdown(sample_report(gpu))
    assert text.startswith("# GPU: Triton kernels and CUDA graphs, 2026-12-02")
    assert "62% of peak bandwidth (goal >= 60%): met" in text  # the default-split row, not the sweep's
    assert "3.00x decode throughput (goal >= 1.5x): met" in text
    assert "| decode attention | q 32 / kv 8 heads, dim 64 | bfloat16 | 4.00e-03 | 0.25 | ok |" in text
    assert "| nan | nan | FAIL |" in text and "1 of 2 checks pass." in text  # NaN fails
    assert "bfloat16 atol 0.02, rtol 0.02" in text
    assert "| 128 | 2048 | 16 (sweep) | contiguous | 500.0 | 6000 | 125% |" in text
    assert "| 1 | triton | on | 2.00 | 500 |  |" in text
    assert "| 1 | torch_native | on | n/a | n/a | no CUDA-graph path |" in text
    assert "- triton, CUDA graphs on vs off: same tokens" in text


def test_goals_not_met_or_not_measured(gpu):
    r = gpu.Report(date="2026-12-02", peak_gbs=None, peak_source="unknown device: pass --peak-bandwidth-gbs")
    text = gpu.render_markdown(r)
    assert "bandwidth goal: not measured" in text and "speedup goal: not measured" in text
    r = sample_report(gpu)
    r.throughput[0].ms_per_step = 5.0
    r.errors = [("decode throughput", "Traceback ...\nRuntimeError: boom")]
    text = gpu.render_markdown(r)
    assert "1.20x decode throughput (goal >= 1.5x): NOT met" in text
    assert "### decode throughput" in text and "RuntimeError: boom" in text


def test_results_file(gpu, tmp_path):
    path = gpu.write_report(sample_report(gpu), tmp_path / "results")
    assert path == tmp_path / "results" / "gpu-2026-12-02.md"
    assert path.read_text() == gpu.render_markdown(sample_report(gpu))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_main_without_cuda_says_so_and_writes_nothing(gpu, tmp_path, capsys):
    assert gpu.main(["--out-dir", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
