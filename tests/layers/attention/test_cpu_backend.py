"""CpuAttnBackend (every query row, decode or prefill, read by the C++ kernel straight
from the KV pool) against attention written out per request in float64; the kernel's checks and
rows it must leave alone; how the backend is chosen and what happens when the kernel
cannot be built; an engine on it gives torch_native's tokens."""

from __future__ import annotations

import logging

import pytest
import torch

from sglite.layers import cpu_ops
from sglite.layers.custom_op import CustomOp
from sglite.layers.attention import torch_native_backend as tn
from sglite.layers.attention.cpu_backend import CpuAttnBackend
from benchmarks.paged_batch import make_paged_case, run_attention
from sglite.model_executor.model_runner import resolve_attention_backend
from tests.layers.attention.test_torch_native_backend import dense_reference, share_prefix


def check(case, rtol: float = 1e-5) -> None:
    got = run_attention(CpuAttnBackend(), case)
    torch.testing.assert_close(got.double(), dense_reference(case), rtol=rtol, atol=rtol)


# head_dim 64 and 128 run code specialised at compile time, 16 and 48 the generic code
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 128), (6, 2, 48)])
def test_decode_equals_reference(heads, kv_heads, head_dim):
    case = make_paged_case([3, 400, 17, 90, 0, 55, 8], [1] * 7, heads, kv_heads, head_dim, decode=True, seed=2)
    backend = CpuAttnBackend()
    backend.init_forward_metadata(case.forward_batch)
    assert backend._rows.tolist() == list(range(7))  # all seven through the kernel
    check(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens", [[400], [30], [0], [700, 5]])
def test_positions_in_ranges_merged_give_float64_attention(prefix_lens, dtype):
    """A request's positions are attended in ranges of 128 in parallel and the softmaxes
    merged (one range when the request is shorter); the result is float64 attention's."""
    case = make_paged_case(prefix_lens, [1] * len(prefix_lens), 9, 3, 64, decode=True, dtype=dtype, seed=7)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-6
    got = run_attention(CpuAttnBackend(), case)
    torch.testing.assert_close(got.double(), dense_reference(case), rtol=tol, atol=tol)


def test_rows_sharing_a_cached_prefix_go_through_the_kernel_too(monkeypatch):
    """torch_native would group these (the threshold is lowered so it does); the cpu
    backend attends every one-row request with the kernel."""
    monkeypatch.setattr(tn, "MIN_SHARED_ROWS_SAVED", 1)
    case = make_paged_case([40, 41, 45, 60, 33, 20, 50, 50], [1] * 8, 9, 3, 64, decode=True, seed=3)
    share_prefix(case, [([0, 1, 2, 3], 30), ([4, 6], 20)])
    native = tn.TorchNativeAttnBackend()
    native.init_forward_metadata(case.forward_batch)
    assert len(native._groups) == 2
    backend = CpuAttnBackend()
    backend.init_forward_metadata(case.forward_batch)
    assert sorted(backend._rows.tolist()) == list(range(8))
    check(case)


def test_mixed_batch_of_prefill_and_one_row_requests():
    # MIXED: two prefill chunks (one with a cached prefix) beside three running requests
    case = make_paged_case([0, 25, 12, 70, 3], [6, 1, 1, 4, 1], 9, 3, 64, seed=4)
    backend = CpuAttnBackend()
    backend.init_forward_metadata(case.forward_batch)
    # every row through the kernel, each as long as its position + 1
    assert backend._rows.tolist() == list(range(6 + 1 + 1 + 4 + 1))
    assert backend._seq_lens.tolist() == [1, 2, 3, 4, 5, 6, 26, 13, 71, 72, 73, 74, 4]
    check(case)


def test_large_scores_do_not_overflow():
    case = make_paged_case([300, 5], [1, 1], 4, 2, 64, decode=True, seed=7)
    case.q.mul_(200.0)
    got = run_attention(CpuAttnBackend(), case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), dense_reference(case), rtol=1e-4, atol=1e-4)


def kernel_args(case):
    fb = case.forward_batch
    pool = fb.token_to_kv_pool
    n = fb.batch_size
    return dict(q=case.q.contiguous(), k_buf=pool.get_key_buffer(0), v_buf=pool.get_value_buffer(0),
                req_to_token=fb.req_to_token_pool.req_to_token, q_rows=torch.arange(n),
                pool_idx=fb.req_pool_indices.clone(), seq_lens=fb.seq_lens.clone(),
                out=torch.full(case.q.shape, float("nan")), scale=case.layer.scaling)


def call(a) -> None:
    cpu_ops.load_cpu_ops().decode_attention(a["q"], a["k_buf"], a["v_buf"], a["req_to_token"], a["q_rows"],
                                            a["pool_idx"], a["seq_lens"], a["out"], a["scale"])


def test_kernel_writes_only_the_rows_it_is_given():
    case = make_paged_case([10, 20, 30, 40], [1] * 4, 4, 2, 64, decode=True, seed=5)
    a = kernel_args(case)
    a["q_rows"], a["pool_idx"], a["seq_lens"] = a["q_rows"][[3, 1]], a["pool_idx"][[3, 1]], a["seq_lens"][[3, 1]]
    call(a)
    want = dense_reference(case)
    assert torch.isnan(a["out"][[0, 2]]).all()
    torch.testing.assert_close(a["out"][[1, 3]].double(), want[[1, 3]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(q=a["q"].double()), "q must be a contiguous float32 or bfloat16 CPU tensor"),
    (lambda a: a.update(k_buf=a["k_buf"].bfloat16()), "k_buf must be Float, not BFloat16"),
    (lambda a: a.update(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)), "q must be a contiguous"),
    (lambda a: a.update(seq_lens=a["seq_lens"].int()), "seq_lens must be a contiguous int64"),
    (lambda a: a.update(q_rows=a["q_rows"][:2]), "must have one length"),
    (lambda a: a["q_rows"].__setitem__(0, 99), "q_rows out of range"),
    (lambda a: a["pool_idx"].__setitem__(0, -1), "pool_idx out of range"),
    (lambda a: a["seq_lens"].__setitem__(1, 0), "seq_lens out of range"),
    (lambda a: a["req_to_token"].__setitem__((a["pool_idx"][2], 3), 10**6), "slot outside the KV pool"),
    (lambda a: a.update(k_buf=a["k_buf"][:, :, :32].contiguous(), v_buf=a["v_buf"][:, :, :32].contiguous()),
     "one head_dim"),
])
def test_kernel_rejects_bad_input_with_a_message(change, message):
    a = kernel_args(make_paged_case([10, 20, 30], [1] * 3, 4, 2, 64, decode=True, seed=6))
    change(a)
    with pytest.raises(RuntimeError, match=message):
        call(a)


def test_auto_is_cpu_on_a_cpu_with_float32_or_bfloat16_and_torch_native_otherwise():
    assert resolve_attention_backend("auto", "cpu", torch.float32) == "cpu"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "cpu"
    assert resolve_attention_backend("auto", "cpu", torch.float16) == "torch_native"
    assert resolve_attention_backend("cpu", "cpu", torch.bfloat16) == "cpu"
    with pytest.raises(ValueError, match="needs float32 or bfloat16 KV pools"):
        resolve_attention_backend("cpu", "cpu", torch.float16)
    with pytest.raises(ValueError, match="runs on a CPU"):
        resolve_attention_backend("cpu", "cuda", torch.bfloat16)


def test_a_kernel_that_cannot_build_falls_back_to_torch_native_with_the_reason(monkeypatch, tmp_path, caplog):
    """A real failed build (a source the compiler rejects): auto says why and uses
    torch_native; asking for cpu is a one-line error; the failure is not retried."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_ops, "SOURCES", [bad])
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpu_ops, "_error", None)
    with caplog.at_level(logging.WARNING, logger="sglite"):
        assert resolve_attention_backend("auto", "cpu", torch.float32) == "torch_native"
    assert "compiling the CPU kernels failed" in caplog.text
    with pytest.raises(ValueError, match=r"^--attention-backend cpu: compiling .* needs no compiler$"):
        resolve_attention_backend("cpu", "cpu", torch.float32)
    bad.unlink()  # a retry would now fail differently; the remembered error is the same one
    with pytest.raises(cpu_ops.KernelBuildError, match="error: .*this"):
        cpu_ops.load_cpu_ops()


def test_engine_tokens_equal_torch_native_through_retracts_and_mixed_rounds():
    """The cpu backend's engine (its attention and its fused norms, RoPE and SiLU) gives
    the torch_native engine's greedy tokens."""
    from sglite.engine import Engine

    prompts = [[(7 * i + j) % 200 + 3 for j in range(20 + 13 * i)] for i in range(8)]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}

    def generate(backend: str) -> list[list[int]]:
        # a pool too small for all eight at once: retracts; mixed chunks put decode rows beside prefill
        engine = Engine("tiny-random", attention_backend=backend, max_total_tokens=320, enable_mixed_chunk=True,
                        chunked_prefill_size=64)
        ops = [m for m in engine.scheduler.tp_worker.model_runner.model.modules() if isinstance(m, CustomOp)]
        assert ops and {m.impl for m in ops} == {"cpu" if backend == "cpu" else "native"}  # norms, RoPE, SiLU too
        try:
            return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        finally:
            engine.shutdown()

    assert generate("cpu") == generate("torch_native")


def test_a_lock_file_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    """torch's build lock, left behind by a build that was killed, would make every
    later load wait for ever; sglite clears it under its own (flock) lock."""
    import os
    import subprocess
    import sys

    build_dir = cpu_ops.load_cpu_ops().__file__.rsplit("/", 1)[0]
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    code = "from sglite.layers.cpu_ops import load_cpu_ops; load_cpu_ops().rmsnorm"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(lock)


def test_a_module_a_killed_build_left_truncated_is_built_again(tmp_path):
    """A .so cut short (a link killed half-way) can look up to date to ninja, and loading
    it kills the process (SIGBUS); the next start relinks it instead."""
    import os
    import shutil
    import subprocess
    import sys

    so = cpu_ops.load_cpu_ops().__file__
    build_dir = tmp_path / os.path.basename(os.path.dirname(so))
    shutil.copytree(os.path.dirname(so), build_dir)
    copy = build_dir / os.path.basename(so)
    size = copy.stat().st_size
    with open(copy, "r+b") as f:
        f.truncate(4096)
    code = ("import torch; from sglite.layers.cpu_ops import load_cpu_ops; x = torch.randn(3, 64); "
            "out = torch.empty_like(x); load_cpu_ops().rmsnorm(x, torch.ones(64), out, 1e-6); "
            "print(torch.allclose(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert "is incomplete (a build was killed?); linking it again" in proc.stderr
    assert copy.stat().st_size == size
