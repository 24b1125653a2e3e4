"""The fused kernels (RMSNorm + residual, SiLU-and-mul, RoPE) against each layer's
torch path: the Triton ones (on CPU under TRITON_INTERPRET=1, tests/conftest.py) and the
C++ CPU ones (sglite/layers/cpu_ops, CPU only)."""

from __future__ import annotations

import pytest
import torch

from sglite.layers import fused_kernels
from sglite.layers.activation import SiluAndMul
from sglite.layers.custom_op import CustomOp, set_custom_op_impl
from sglite.layers.layernorm import RMSNorm
from sglite.layers.rotary_embedding import get_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"rtol": 1e-5, "atol": 1e-5}
IMPLS = ["triton", pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu", reason="C++ CPU kernels"))]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hidden", [64, 96, 576])  # 96: a row that is not a power of two; 576: smollm2's
def test_rmsnorm_with_and_without_residual(impl, hidden):
    norm = RMSNorm(hidden, eps=1e-5).to(DEVICE)
    norm.weight.data = 1 + 0.1 * randn(hidden, seed=1)
    x, res = randn(5, hidden, seed=2), randn(5, hidden, seed=3)
    kernel = getattr(norm, f"forward_{impl}")
    torch.testing.assert_close(kernel(x), norm.forward_native(x), **TOL)
    out, new_res = kernel(x, res)
    ref_out, ref_res = norm.forward_native(x, res)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(new_res, ref_res, **TOL)
    assert torch.equal(x, randn(5, hidden, seed=2)), "inputs are not modified"


@pytest.mark.parametrize("block_t", [1, 4])  # 1: the CUDA setting; 4: a partial last block of rows
def test_kernels_with_each_rows_per_program(block_t):
    x, res, w = randn(5, 64, seed=1), randn(5, 64, seed=2), randn(64, seed=3)
    norm = RMSNorm(64).to(DEVICE)
    norm.weight.data = w
    for got, want in zip(fused_kernels.rmsnorm(x, w, 1e-6, res, block_t=block_t), norm.forward_native(x, res)):
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(fused_kernels.silu_and_mul(x, block_t=block_t), SiluAndMul().forward_native(x), **TOL)
    rope = get_rope(16, max_position=8, base=10000.0).to(DEVICE)
    q, k, pos = randn(5, 4, 16, seed=4), randn(5, 2, 16, seed=5), torch.tensor([0, 1, 2, 3, 7], device=DEVICE)
    got = fused_kernels.rotary_embedding_neox(pos, q, k, rope.cos_sin_cache, block_t=block_t)
    for g, want in zip(got, rope.forward_native(pos, q, k)):
        torch.testing.assert_close(g, want, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_silu_and_mul(impl):
    act = SiluAndMul()
    kernel = getattr(act, f"forward_{impl}")
    x = randn(7, 2 * 80) * 10  # large gates both ways: exp must neither overflow nor lose the sign
    torch.testing.assert_close(kernel(x), act.forward_native(x), **TOL)
    assert kernel(x[:0]).shape == (0, 80)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 4), (128, 6, 2)])
def test_rope_on_strided_q_k_views(impl, head_dim, heads, kv_heads):
    """q and k are views into the fused qkv projection, as in LlamaAttention."""
    rope = get_rope(head_dim, max_position=64, base=10000.0).to(DEVICE)
    n = 5
    qkv = randn(n, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 40, 63], device=DEVICE)
    q_out, k_out = getattr(rope, f"forward_{impl}")(positions, q, k)
    q_ref, k_ref = rope.forward_native(positions, q, k)
    torch.testing.assert_close(q_out, q_ref, **TOL)
    torch.testing.assert_close(k_out, k_ref, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_set_custom_op_impl_switches_every_custom_op_of_a_model(impl):
    model = torch.nn.Sequential(RMSNorm(8), torch.nn.Sequential(SiluAndMul())).to(DEVICE)
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert len(ops) == 2 and all(op.impl == "native" for op in ops)
    set_custom_op_impl(model, impl)
    assert all(op.impl == impl for op in ops)
    x = randn(3, 8)
    torch.testing.assert_close(model(x), SiluAndMul().forward_native(RMSNorm(8).to(DEVICE).forward_native(x)), **TOL)
    with pytest.raises(ValueError, match="unknown custom op implementation 'cuda'"):
        set_custom_op_impl(model, "cuda")


@pytest.mark.skipif(DEVICE != "cpu", reason="C++ CPU kernels")
def test_cpu_kernels_reject_bad_input_with_a_message():
    from sglite.layers.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    x = randn(4, 16)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16 CPU tensor"):
        ops.rmsnorm(x.double(), torch.ones(16), torch.empty(4, 16), 1e-6)
    with pytest.raises(RuntimeError, match="rmsnorm: shapes do not match"):
        ops.rmsnorm(x, torch.ones(8), torch.empty(4, 16), 1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul: shapes do not match"):
        ops.silu_and_mul(x, torch.empty(4, 16))
    rope = get_rope(16, max_position=8, base=10000.0)
    with pytest.raises(RuntimeError, match="a position is beyond the cos/sin cache"):
        ops.rope_neox(torch.tensor([0, 1, 2, 8]), x.view(4, 1, 16), rope.cos_sin_cache, torch.empty(4, 1, 16))
