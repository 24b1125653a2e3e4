"""The triton attention kernels against the torch_native backend (the reference) on
small random paged batches: ragged lengths, prefix 0 and > 0, GQA ratios 1 and 3,
head dims 64 and 128, scattered KV slots. On CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from benchmarks.paged_batch import make_paged_case, run_attention
from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglite.layers.attention.triton_backend import TritonAttnBackend
from sglite.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from sglite.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from sglite.layers.attention.triton_ops.kv_store import store_kv_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"rtol": 1e-5, "atol": 1e-5}
# (q heads, kv heads, head_dim): GQA ratio 1 and 3, head dims 64 and 128
SHAPES = [(2, 2, 64), (6, 2, 64), (2, 2, 128), (3, 1, 128)]


def compare(prefix_lens, extend_lens, heads, kv_heads, head_dim, decode=False, seed=0):
    """Run both backends on identical fresh cases; return (triton out, reference out,
    triton case, reference case)."""
    case_t = make_paged_case(prefix_lens, extend_lens, heads, kv_heads, head_dim, decode=decode, seed=seed, device=DEVICE)
    case_r = make_paged_case(prefix_lens, extend_lens, heads, kv_heads, head_dim, decode=decode, seed=seed, device=DEVICE)
    out = run_attention(TritonAttnBackend(DEVICE, kv_heads), case_t)
    ref = run_attention(TorchNativeAttnBackend(), case_r)
    return out, ref, case_t, case_r


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_extend_ragged_batch_with_and_without_prefix(heads, kv_heads, head_dim):
    # prefix 0 and > 0, a 1-row extend (a MIXED decode row), a prefix past one block
    out, ref, case_t, case_r = compare([0, 5, 70, 0], [7, 1, 3, 20], heads, kv_heads, head_dim)
    torch.testing.assert_close(out, ref, **TOL)
    pool_t, pool_r = case_t.forward_batch.token_to_kv_pool, case_r.forward_batch.token_to_kv_pool
    assert torch.equal(pool_t.k_buffer[0], pool_r.k_buffer[0]) and torch.equal(pool_t.v_buffer[0], pool_r.v_buffer[0])


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_decode_ragged_batch(heads, kv_heads, head_dim):
    # seq_lens 1 (no prefix), short, and longer than a block; 4 splits, some empty
    out, ref, _, _ = compare([0, 6, 150], [1, 1, 1], heads, kv_heads, head_dim, decode=True)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("block,head_dim", [(16, 64), (64, 128)])  # (64, 128): the bf16 CUDA blocks
def test_extend_with_explicit_blocks_crosses_block_boundaries(block, head_dim):
    """BLOCK_M = BLOCK_N = 16: many row blocks, prefix and causal loops of several steps,
    a partial last block, and blocks past a short request's rows."""
    case = make_paged_case([0, 37, 3], [40, 17, 2], 6, 2, head_dim, seed=1, device=DEVICE)
    ref = run_attention(TorchNativeAttnBackend(), case)
    fb, k_buf = case.forward_batch, case.forward_batch.token_to_kv_pool.k_buffer[0]
    out = torch.empty_like(case.q)
    extend_attention_fwd(case.q, case.k, case.v, out, k_buf, fb.token_to_kv_pool.v_buffer[0],
                         fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens,
                         fb.extend_seq_lens, fb.extend_start_loc, max(fb.extend_seq_lens_cpu), case.layer.scaling,
                         block_m=block, block_n=block)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("num_kv_splits,block_n", [(1, 64), (3, 16), (8, 16)])
def test_decode_split_counts(num_kv_splits, block_n):
    """One split (stage 2 is a copy), a few, and more splits than a short request fills."""
    case = make_paged_case([100, 9, 0], [1, 1, 1], 6, 2, 64, decode=True, seed=2, device=DEVICE)
    ref = run_attention(TorchNativeAttnBackend(), case)  # also stores the new rows' K/V
    fb, pool = case.forward_batch, case.forward_batch.token_to_kv_pool
    out = torch.empty_like(case.q)
    decode_attention_fwd(case.q, pool.k_buffer[0], pool.v_buffer[0], out, fb.req_to_token_pool.req_to_token,
                         fb.req_pool_indices, fb.seq_lens, num_kv_splits, case.layer.scaling, block_n=block_n)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("block_t", [None, 1])  # 1 row per program: the CUDA setting
def test_store_kv_cache_equals_set_kv_buffer(block_t):
    case = make_paged_case([3, 0], [4, 2], 2, 2, 128, device=DEVICE)
    fb, pool = case.forward_batch, case.forward_batch.token_to_kv_pool
    k_ref, v_ref = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    k_ref[fb.out_cache_loc], v_ref[fb.out_cache_loc] = case.k, case.v
    # a view into a wider tensor, as k and v are views into the fused qkv projection
    kv = torch.cat([case.k, case.v], dim=1)
    store_kv_cache(pool.k_buffer[0], pool.v_buffer[0], fb.out_cache_loc, kv[:, :2], kv[:, 2:], block_t=block_t)
    assert torch.equal(pool.k_buffer[0], k_ref) and torch.equal(pool.v_buffer[0], v_ref)
