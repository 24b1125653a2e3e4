"""Extend (prefill) attention over the paged KV cache (SGLang:
layers/attention/triton_ops/extend_attention.py, ``extend_attention_fwd``).

A program owns BLOCK_M new rows of one request and one query head. It runs one online
softmax over two key ranges, in order:

1. the request's cached prefix, positions ``0 .. prefix_len-1``, whose K/V sit in the
   pool at the slots ``req_to_token[req_pool_idx, pos]`` (a gather per block);
2. the request's new rows themselves, read straight from ``k_extend`` / ``v_extend``,
   with the causal mask (new row i sees new rows 0..i).

GQA: query head h reads kv head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc):
    """Fold one block of scores ``qk`` [M, N] and values ``v`` [N, D] into the running
    max ``m_i``, denominator ``l_i`` and unnormalised output ``acc``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _load_tile(Base, rows, stride_row, head_offset, offs_d, mask):
    """One head's vectors at ``rows``: [len(rows), BLOCK_D], zeros where masked."""
    return tl.load(Base + rows[:, None] * stride_row + head_offset + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _fwd_kernel_extend(
    Q_Extend, K_Extend, V_Extend, O_Extend, K_Buffer, V_Buffer,
    Req_to_token, Req_pool_indices, Prefix_lens, Extend_seq_lens, Extend_start_loc,
    sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    KV_GROUP_NUM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    kvh = h // KV_GROUP_NUM
    m_start = tl.program_id(2) * BLOCK_M

    ext_len = tl.load(Extend_seq_lens + b)
    prefix_len = tl.load(Prefix_lens + b)
    start = tl.load(Extend_start_loc + b).to(tl.int64)
    req = tl.load(Req_pool_indices + b).to(tl.int64)

    offs_m, offs_d = m_start + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    m_mask, d_mask = offs_m < ext_len, offs_d < HEAD_DIM
    q = _load_tile(Q_Extend, start + offs_m, stride_qt, h * stride_qh, offs_d, m_mask[:, None] & d_mask[None, :])

    # a block past this request's rows (the grid covers the longest request) does no work
    live = m_start < ext_len
    prefix_end = tl.where(live, prefix_len, 0)
    extend_end = tl.where(live, tl.minimum(m_start + BLOCK_M, ext_len), 0)

    # online softmax state: running max, denominator, unnormalised output
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # 1. the cached prefix, gathered through req_to_token
    for n0 in range(0, prefix_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_end
        slots = tl.load(Req_to_token + req * stride_r2t + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _load_tile(K_Buffer, slots, stride_kbs, kvh * stride_kbh, offs_d, kv_mask)
        qk = tl.dot(q, tl.trans(k)) * sm_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        v = _load_tile(V_Buffer, slots, stride_vbs, kvh * stride_vbh, offs_d, kv_mask)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc)

    # 2. the new rows, causal
    for n0 in range(0, extend_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < extend_end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _load_tile(K_Extend, start + offs_n, stride_kt, kvh * stride_kh, offs_d, kv_mask)
        qk = tl.dot(q, tl.trans(k)) * sm_scale
        causal = (offs_m[:, None] >= offs_n[None, :]) & n_mask[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        v = _load_tile(V_Extend, start + offs_n, stride_vt, kvh * stride_vh, offs_d, kv_mask)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows of a dead block: stored nowhere, kept finite
    out = acc / l_i[:, None]
    tl.store(O_Extend + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O_Extend.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _default_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps); float32 tiles of head dim 128 are halved to fit shared memory."""
    if head_dim <= 64:
        return 64, 64, 4
    return (64, 32, 8) if dtype == torch.float32 else (64, 64, 8)


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    """q/o: [new rows, q_heads, head_dim]; k/v_extend: [new rows, kv_heads, head_dim];
    k/v_buffer: [slots, kv_heads, head_dim]; the per-request tensors are [bs]."""
    bs = req_pool_indices.shape[0]
    num_heads, head_dim = q_extend.shape[1], q_extend.shape[2]
    kv_group_num = num_heads // k_extend.shape[1]
    bm, bn, warps = _default_blocks(head_dim, q_extend.dtype)
    bm, bn = block_m or bm, block_n or bn
    if bs == 0 or max_len_extend == 0:
        return
    for t in (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer):
        assert t.stride(-1) == 1, "the head dim must be contiguous"
    grid = (bs, num_heads, triton.cdiv(max_len_extend, bm))
    _fwd_kernel_extend[grid](
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        req_to_token, req_pool_indices, prefix_lens, extend_seq_lens, extend_start_loc,
        sm_scale,
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        KV_GROUP_NUM=kv_group_num, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=2,
    )
