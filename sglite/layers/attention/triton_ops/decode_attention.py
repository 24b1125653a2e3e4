"""Decode attention over the paged KV cache, split-KV in the flash-decoding style
(SGLang: layers/attention/triton_ops/decode_attention.py, ``decode_attention_fwd``).

Decode has one query row per request, so a program per (request, head) would leave
most of the GPU idle on a small batch and read each KV head once per query head.
Stage 1 therefore runs a program per (request, kv head, split): it loads the query
rows of every head in the kv head's group at once (GQA: one read of K/V serves the
whole group, through a [heads, BLOCK_N] matmul) and attends over one contiguous
slice of the request's positions, writing a partial output and its log-sum-exp.
Stage 2 merges a request's splits with the usual rescaling by ``exp(lse - max)``.

The number of splits is a compile-time constant chosen by the caller per batch size,
never per sequence length, so a CUDA graph captured for a batch size replays for any
lengths. Each request's split length is computed in the kernel from its own
``seq_len`` (rounded up to whole blocks, so a short request uses fewer splits and the
rest are empty), which is also what stage 2 recomputes to skip the empty ones.

Batch invariance (``split_tile > 0``; ``--enable-deterministic-inference``, on by
default): every split is ``split_tile`` positions long, starting at multiples of it, so a
row's KV is cut at the same places whatever the batch size or the number of splits, and
stage 2 merges the splits in position order. Trailing empty splits change nothing (their
weight is exactly 0 and their scale exactly 1). A query row then gets the same bits
alone or in any batch, and (through ``TritonAttnBackend``, which sends extend rows here
too) in a prefill, a prefill chunk, a mixed round or a decode step.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

MAX_KV_SPLITS = 16


@triton.jit
def _split_len(seq_len, NUM_KV_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILE: tl.constexpr):
    if SPLIT_TILE > 0:  # batch-invariant: fixed positions, a multiple of BLOCK_N
        return SPLIT_TILE + 0 * seq_len
    return tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_grouped_stage1(
    Q, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices, Seq_lens, Mid_O, Mid_LSE,
    sm_scale,
    stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    KV_GROUP_NUM: tl.constexpr, Q_HEAD_NUM: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KV_SPLITS: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * KV_GROUP_NUM + offs_h
    h_mask = (offs_h < KV_GROUP_NUM) & (heads < Q_HEAD_NUM)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    seq_len = tl.load(Seq_lens + b)
    req = tl.load(Req_pool_indices + b).to(tl.int64)
    split_len = _split_len(seq_len, NUM_KV_SPLITS, BLOCK_N, SPLIT_TILE)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    for n0 in range(split_start, split_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < split_end
        slots = tl.load(Req_to_token + req * stride_r2t + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K_Buffer + slots[:, None] * stride_kbs + kvh * stride_kbh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k)) * sm_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        v = tl.load(V_Buffer + slots[:, None] * stride_vbs + kvh * stride_vbh + offs_d[None, :], mask=kv_mask, other=0.0)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # an empty split stores nothing; stage 2 skips it by the same arithmetic
    store_h = h_mask & (split_start + 0 * offs_h < split_end)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    mid_o = Mid_O + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
    tl.store(mid_o, acc / l_safe[:, None], mask=store_h[:, None] & d_mask[None, :])
    tl.store(Mid_LSE + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log(l_safe), mask=store_h)


@triton.jit
def _decode_softmax_reducev_stage2(
    Mid_O, Mid_LSE, O, Seq_lens,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KV_SPLITS: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    seq_len = tl.load(Seq_lens + b)
    split_len = _split_len(seq_len, NUM_KV_SPLITS, BLOCK_N, SPLIT_TILE)

    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # split 0 is never empty (seq_len >= 1), so m is finite after the first step and an
    # empty split's -inf adds exp(-inf) = 0. An empty split's slots were never written:
    # tl.where (not a product with 0) keeps their garbage, NaN included, out
    for s in range(0, NUM_KV_SPLITS):
        nonempty = s * split_len < seq_len
        lse = tl.load(Mid_LSE + b * stride_mlb + h * stride_mlh + s)
        lse = tl.where(nonempty, lse, float("-inf"))
        o = tl.load(Mid_O + b * stride_mob + h * stride_moh + s * stride_mos + offs_d, mask=d_mask, other=0.0)
        o = tl.where(nonempty, o, 0.0)
        m_new = tl.maximum(m, lse)
        scale = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * scale + w * o
        denom = denom * scale + w
        m = m_new
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, (acc / denom).to(O.dtype.element_ty), mask=d_mask)


def num_kv_splits_for(batch_size: int, num_kv_heads: int, device: torch.device | str,
                      split_tile: int = 0, context_len: int = 0) -> int:
    """Enough splits that stage 1 has a few programs per SM (2 splits at least, so the
    merge is always exercised), at most MAX_KV_SPLITS; fixed per batch size. With a fixed
    ``split_tile``: as many as the longest context needs (fixed per model, so a CUDA graph
    captured for a batch size still replays for any lengths)."""
    if split_tile > 0:
        return max(1, -(-context_len // split_tile))
    if not str(device).startswith("cuda"):
        return 2  # CPU interpreter (tests): a merge to do, few programs to interpret
    want = -(-8 * _sm_count(str(device)) // max(1, batch_size * num_kv_heads))
    return max(2, min(MAX_KV_SPLITS, want))


@lru_cache(maxsize=None)
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
    attn_logits: torch.Tensor | None = None,
    attn_lse: torch.Tensor | None = None,
    block_n: int | None = None,
    split_tile: int = 0,
) -> None:
    """q/o: [bs, q_heads, head_dim]; k/v_buffer: [slots, kv_heads, head_dim]; seq_lens
    count the current token, whose K/V must already be in the buffers.
    ``attn_logits`` [bs, q_heads, splits, head_dim] and ``attn_lse`` [bs, q_heads, splits]
    (float32) hold the partial results; allocated here when not given. ``split_tile`` > 0
    cuts every row's KV at multiples of it (batch-invariant; ``num_kv_splits`` splits must
    cover the longest ``seq_len``); 0 spreads each row over ``num_kv_splits``."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    kv_group_num = num_heads // num_kv_heads
    if bs == 0:
        return
    # float32 K/V tiles of head dim 128 are twice as large: halve them to fit shared memory
    block_n = block_n or (32 if q.dtype == torch.float32 and head_dim > 64 else 64)
    if split_tile % block_n:
        raise ValueError(f"split_tile {split_tile} must be a multiple of the KV block {block_n}")
    if attn_logits is None:
        attn_logits = torch.empty((bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    if attn_lse is None:
        attn_lse = torch.empty((bs, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_grouped_stage1[(bs, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, attn_logits, attn_lse,
        sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2), attn_lse.stride(0), attn_lse.stride(1),
        KV_GROUP_NUM=kv_group_num, Q_HEAD_NUM=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(kv_group_num)), BLOCK_N=block_n, NUM_KV_SPLITS=num_kv_splits,
        SPLIT_TILE=split_tile, num_warps=4, num_stages=2,
    )
    _decode_softmax_reducev_stage2[(bs, num_heads)](
        attn_logits, attn_lse, o, seq_lens,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2), attn_lse.stride(0), attn_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, NUM_KV_SPLITS=num_kv_splits,
        SPLIT_TILE=split_tile, num_warps=4 if head_dim > 64 else 2,
    )
