"""Triton kernels of the fused layers: RMSNorm (with the residual add), SiLU-and-mul
and neox RoPE. Each is the ``forward_triton`` of its layer (layernorm.py,
activation.py, rotary_embedding.py) and computes what the layer's ``forward_native``
does, in float32 inside the kernel, rounding where the torch code rounds.

A program handles BLOCK_T rows (tokens) and reads each element once and writes it
once: the point of fusing is that norm, gate and rotation cost a single pass over
memory instead of the several passes of the unfused torch code. On CUDA BLOCK_T is 1
(a program per row); under the CPU interpreter, whose cost is per operation and per
program rather than per element, it is 16, which keeps the interpret tests fast."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rows_per_program(device: torch.device) -> int:
    return 1 if device.type == "cuda" else 16


@triton.jit
def _rmsnorm_kernel(
    X, Residual, ResidualOut, W, Out,
    stride_x, stride_r, stride_ro, stride_o,
    T, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (rows < T) & (offs < N)
    x = tl.load(X + rows * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + rows * stride_r + offs, mask=mask, other=0.0)
        # the sum is rounded to the model dtype, as torch's `x + residual` is
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + rows * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)[:, None]
    h = (xf * rstd).to(Out.dtype.element_ty)
    w = tl.load(W + offs, mask=offs < N, other=0.0)
    tl.store(Out + rows * stride_o + offs, (w.to(tl.float32) * h.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    block_t: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x) * weight``; with a residual, ``(norm(x + residual) * weight, x + residual)``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    block_t = block_t or rows_per_program(x.device)
    if residual is None:
        r2 = res_out = x2  # unused by the kernel
    else:
        r2 = residual.reshape(-1, n).contiguous()
        res_out = torch.empty_like(out)
    if rows:
        _rmsnorm_kernel[(triton.cdiv(rows, block_t),)](
            x2, r2, res_out, weight, out,
            x2.stride(0), r2.stride(0), res_out.stride(0), out.stride(0),
            rows, n, eps, HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK=block,
            num_warps=_num_warps(block),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, T, D, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (rows < T) & (cols < D)
    gate = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + rows * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(Out + rows * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block_t: int | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate_up projection's output."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    block_t = block_t or rows_per_program(x.device)
    if rows:
        _silu_and_mul_kernel[(triton.cdiv(rows, block_t), triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), rows, d, BLOCK_T=block_t, BLOCK=block,
            num_warps=_num_warps(block),
        )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _rope_neox_rows(
    X, Out, toks, tok_mask, cos, sin, stride_xt, stride_xh, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotate every head of the tokens ``toks`` [BLOCK_T, 1, 1]; cos/sin [BLOCK_T, 1, BLOCK_HALF]."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    offs = tl.arange(0, BLOCK_HALF)[None, None, :]
    mask = tok_mask & (heads < NUM_HEADS) & (offs < HALF)
    src = X + toks * stride_xt + heads * stride_xh + offs
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Out + toks * stride_ot + heads * stride_oh + offs
    tl.store(dst, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_neox_kernel(
    Positions, Q, K, QOut, KOut, CosSin,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs, T,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    tok_mask = toks < T
    pos = tl.load(Positions + toks, mask=tok_mask, other=0)
    offs = tl.arange(0, BLOCK_HALF)[None, None, :]
    cs_mask = tok_mask & (offs < HALF)
    cos = tl.load(CosSin + pos * stride_cs + offs, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs, mask=cs_mask, other=0.0).to(tl.float32)
    _rope_neox_rows(Q, QOut, toks, tok_mask, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
                    NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    _rope_neox_rows(K, KOut, toks, tok_mask, cos, sin, stride_kt, stride_kh, stride_kot, stride_koh,
                    NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_embedding_neox(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    block_t: int | None = None,
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
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    block_t = block_t or rows_per_program(q.device)
    if n:
        _rope_neox_kernel[(triton.cdiv(n, block_t),)](
            positions, q, k, q_out, k_out, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0), n,
            NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=half, BLOCK_T=block_t,
            BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out
