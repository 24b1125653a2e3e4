"""bfloat16 on a CPU: the packed linear (gemm.cpp) against float64 sums of the same
bfloat16 values at batch 1, 7, 64 and odd shapes; the bfloat16 RMSNorm, SiLU-and-mul,
RoPE and decode attention against their torch paths and float64 attention; how
``--dtype auto`` decides."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from benchmarks.paged_batch import make_paged_case, run_attention
from sglite.layers.activation import SiluAndMul
from sglite.layers.attention.cpu_backend import CpuAttnBackend
from sglite.layers.cpu_ops import load_cpu_ops
from sglite.layers.layernorm import RMSNorm
from sglite.layers.linear import ReplicatedLinear
from sglite.layers.rotary_embedding import get_rope
from sglite.model_executor import model_runner
from tests.layers.attention.test_torch_native_backend import dense_reference

BF16_ULP = 2.0**-7  # bfloat16 keeps 8 significant bits: spacing up to 2^-7 of a value, rounding half that


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The exact sums of the bfloat16 values, in float64."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# (M, N, K): batch 1 (the GEMV), 7 (row tiles of 4 + 3), 64 (tiles of 8), SmolLM2's
# shapes, and odd ones: N not a multiple of 16 (padded block), odd K (padded pair), N = 1
SHAPES = [(1, 960, 576), (7, 3072, 576), (64, 576, 1536), (64, 101, 128), (3, 17, 9), (13, 33, 64), (2, 1, 5),
          (9, 48, 2)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_the_exact_sums(m, n, k, bias):
    ops = load_cpu_ops()
    w, x = rand(n, k, seed=1).bfloat16(), rand(m, k, seed=2).bfloat16()
    b = rand(n, seed=3) if bias else None
    want = reference(x, w, b)
    packed = ops.convert_weight_packed(w)
    assert packed.shape == (-(-n // 16) * 16, k + k % 2) and packed.dtype == torch.bfloat16
    got32 = ops.weight_packed_linear(x, packed, b, n, True)
    assert got32.dtype == torch.float32 and got32.shape == (m, n)
    # float32 sums of k products: within float32 rounding of the sum of magnitudes
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    assert ((got32.double() - want).abs() <= 1e-6 * scale + 1e-6).all()
    got16 = ops.weight_packed_linear(x, packed, b, n)
    assert got16.dtype == torch.bfloat16
    # the float32 result rounded once to bfloat16
    assert ((got16.double() - got32.double()).abs() <= BF16_ULP / 2 * got32.double().abs() + 1e-30).all()


def test_packed_linear_takes_strided_rows_and_leading_dimensions():
    ops = load_cpu_ops()
    w = rand(40, 24, seed=4).bfloat16()
    packed = ops.convert_weight_packed(w)
    wide = rand(5, 64, seed=5).bfloat16()
    x = wide[:, 8:32]  # rows 64 apart: a view into a wider tensor, as q/k/v are
    torch.testing.assert_close(ops.weight_packed_linear(x, packed, None, 40, True),
                               reference(x, w, None).float(), rtol=1e-5, atol=1e-5)
    x3 = rand(2, 3, 24, seed=6).bfloat16()
    assert ops.weight_packed_linear(x3, packed, None, 40).shape == (2, 3, 40)
    assert ops.weight_packed_linear(x3[:0], packed, None, 40).shape == (0, 3, 40)


def test_packed_linear_rejects_bad_input_with_a_message():
    ops = load_cpu_ops()
    w = rand(32, 16, seed=7).bfloat16()
    packed = ops.convert_weight_packed(w)
    x = rand(2, 16, seed=8).bfloat16()
    for call, message in [
        (lambda: ops.weight_packed_linear(x.float(), packed, None, 32), "packed must be a contiguous float32 \\(x is"),
        (lambda: ops.weight_packed_linear(x.double(), packed, None, 32), "x must be a bfloat16 or float32 CPU tensor"),
        (lambda: ops.weight_packed_linear(x[:, :8], packed, None, 32), "x has 8 columns; the weight has 16"),
        (lambda: ops.weight_packed_linear(x, w.t().contiguous(), None, 32), "must come from convert_weight_packed"),
        (lambda: ops.weight_packed_linear(x, packed, None, 5), "must come from convert_weight_packed"),
        (lambda: ops.weight_packed_linear(x, packed, torch.ones(3), 32), "bias must have 32 values"),
    ]:
        with pytest.raises(RuntimeError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def test_replicated_linear_packs_once_and_keeps_its_outputs():
    layer = ReplicatedLinear(24, 40, bias=True)
    layer.weight.data, layer.bias.data = rand(40, 24, seed=9).bfloat16(), rand(40, seed=10).bfloat16()
    x = rand(3, 24, seed=11).bfloat16()
    want = layer(x, out_float32=True)  # F.linear before packing
    layer.pack()
    layer.pack()  # a second call is a no-op
    assert layer.packed and layer.weight.shape == (48, 24) and "packed bf16" in repr(layer)
    torch.testing.assert_close(layer(x, out_float32=True), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="needs a bfloat16 or float32 CPU weight"):
        ReplicatedLinear(4, 4).to(torch.float64).pack()


def test_bf16_rmsnorm_silu_rope_equal_the_torch_path_to_one_rounding():
    tol = {"rtol": BF16_ULP, "atol": BF16_ULP}
    norm = RMSNorm(576, eps=1e-5).bfloat16()
    norm.weight.data = (1 + 0.1 * rand(576, seed=1)).bfloat16()
    x, res = rand(5, 576, seed=2).bfloat16(), rand(5, 576, seed=3).bfloat16()
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), **tol)
    for got, want in zip(norm.forward_cpu(x, res), norm.forward_native(x, res)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, **tol)
    act = SiluAndMul()
    g = (rand(7, 160, seed=4) * 10).bfloat16()
    torch.testing.assert_close(act.forward_cpu(g), act.forward_native(g), **tol)
    rope = get_rope(64, max_position=64, base=10000.0)
    qkv = rand(5, (9 + 6) * 64, seed=5).bfloat16()
    q, k = qkv[:, : 9 * 64].reshape(5, 9, 64), qkv[:, 9 * 64 : 12 * 64].reshape(5, 3, 64)
    pos = torch.tensor([0, 1, 2, 40, 63])
    for got, want in zip(rope.forward_cpu(pos, q, k), rope.forward_native(pos, q, k)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (6, 2, 48)])
def test_bf16_decode_attention_equals_float64_attention(heads, kv_heads, head_dim):
    case = make_paged_case([3, 400, 17, 90, 0, 55], [1] * 6, heads, kv_heads, head_dim, decode=True,
                           dtype=torch.bfloat16, seed=2)
    got = run_attention(CpuAttnBackend(), case)
    assert got.dtype == torch.bfloat16
    # float32 arithmetic over bfloat16 inputs, one rounding of the output
    torch.testing.assert_close(got.double(), dense_reference(case), rtol=2 * BF16_ULP, atol=2 * BF16_ULP)


def test_auto_dtype_follows_the_cpu_flags_and_says_why(monkeypatch, caplog):
    monkeypatch.delenv(model_runner.CPU_DTYPE_ENV, raising=False)
    monkeypatch.setattr(model_runner, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    assert model_runner.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert "this CPU has avx512_bf16" in model_runner.describe_cpu_dtype("auto", torch.bfloat16)
    monkeypatch.setattr(model_runner, "cpu_bf16_flags", lambda: [])
    assert model_runner.resolve_dtype("auto", "cpu") == torch.float32
    assert "no bfloat16 dot products" in model_runner.describe_cpu_dtype("auto", torch.float32)
    assert model_runner.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert model_runner.resolve_dtype("float32", "cpu") == torch.float32
    monkeypatch.setenv(model_runner.CPU_DTYPE_ENV, "bfloat16")
    assert model_runner.resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setenv(model_runner.CPU_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match="SGLITE_CPU_DTYPE must be float32 or bfloat16"):
        model_runner.resolve_dtype("auto", "cpu")


def test_cpu_flags_come_from_proc_cpuinfo():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    want = [f for f in ("avx512_bf16", "amx_bf16") if f" {f}" in flags]
    assert model_runner.cpu_bf16_flags() == want
    if "avx512_bf16" in want:
        assert load_cpu_ops().cpu_has_avx512_bf16()  # -march=native builds the dot-product kernel


def test_a_bf16_engine_logs_its_dtype_and_packs(caplog):
    from sglite.engine import Engine

    with caplog.at_level(logging.INFO, logger="sglite"):
        engine = Engine(model_path="tiny-random", dtype="bfloat16", max_total_tokens=256, log_level="info")
    try:
        assert "dtype bfloat16 (--dtype bfloat16)" in caplog.text
        assert "bfloat16, packed linears" in caplog.text
        out = engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                         "ignore_eos": True})
        assert len(out[0]["output_ids"]) == 4
    finally:
        engine.shutdown()
