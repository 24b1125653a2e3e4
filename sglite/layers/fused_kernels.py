"""Triton kernels of the fused layers: RMSNorm (with the residual add), SiLU-and-mul
and neox RoPE. Each is the ``forward_triton`` of its layer (layernorm.py,
activation.py, rotary_embedding.py) and computes what the layer's ``forward_native``
does, in float32 inside the kernel, rounding where the torch code rounds.

One program handles one row (one token), so a kernel reads each element once and
writes it once: the point of fusing is that norm, gate and rotation cost a single
pass over memory instead of the several passes of the unfused torch code."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _rmsnorm_kernel(
    X, Residual, ResidualOut, W, Out,
    stride_x, stride_r, stride_ro, stride_o,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        # the sum is rounded to the model dtype, as torch's `x + residual` is
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    h = (xf * rstd).to(Out.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + offs, (w.to(tl.float32) * h.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x) * weight``; with a residual, ``(norm(x + residual) * weight, x + residual)``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    if residual is None:
        r2 = res_out = x2  # unused by the kernel
    else:
        r2 = residual.reshape(-1, n).contiguous()
        res_out = torch.empty_like(out)
    if rows:
        _rmsnorm_kernel[(rows,)](
            x2, r2, res_out, weight, out,
            x2.stride(0), r2.stride(0), res_out.stride(0), out.stride(0),
            n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate_up projection's output."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=_num_warps(block),
        )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _rope_neox_rows(
    X, Out, t, cos, sin, stride_xt, stride_xh, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < NUM_HEADS)[:, None] & (offs < HALF)[None, :]
    src = X + t * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Out + t * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_neox_kernel(
    Positions, Q, K, QOut, KOut, CosSin,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(Positions + t)
    offs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(CosSin + pos * stride_cs + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    _rope_neox_rows(Q, QOut, t, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
                    NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    _rope_neox_rows(K, KOut, t, cos, sin, stride_kt, stride_kh, stride_kot, stride_koh,
                    NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_embedding_neox(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim];
    ``cos_sin_cache[pos]`` is ``cat(cos, sin)`` over head_dim / 2 frequencies."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    n, hq, d = q.shape
    hk = k.shape[1]
    half = d // 2
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)
    if n:
        _rope_neox_kernel[(n,)](
            positions, q, k, q_out, k_out, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=half,
            BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out
