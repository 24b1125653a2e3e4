"""A random ragged batch over real KV pools, for checking one attention backend against
another: the kernel tests compare TritonAttnBackend with TorchNativeAttnBackend on it,
and benchmarks/gpu.py does the same on a GPU and times decode on it.

Requests get ``req_pool_idx`` in reverse order and (by default) KV slots in a random
permutation, so a kernel that assumes contiguous slots or ``req_pool_idx == i`` fails.
Every pool slot starts random, the new rows' slots included: a missing K/V store shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglite.layers.attention.base_attn_backend import AttentionBackend
from sglite.layers.radix_attention import RadixAttention
from sglite.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglite.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@dataclass
class PagedAttentionCase:
    forward_batch: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor  # [new rows, q_heads, head_dim]
    k: torch.Tensor  # [new rows, kv_heads, head_dim]
    v: torch.Tensor


def make_paged_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    decode: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    shuffle_slots: bool = True,
) -> PagedAttentionCase:
    """``decode=True`` needs every extend_len to be 1 (the row being decoded)."""
    if decode and any(e != 1 for e in extend_lens):
        raise ValueError("a decode batch has one new row per request")
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    total = sum(seq_lens)
    cpu_gen = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    pool = MHATokenToKVPool(total, 1, dtype, num_kv_heads, head_dim, 1, device)
    pool.k_buffer[0].copy_(randn(*pool.k_buffer[0].shape))
    pool.v_buffer[0].copy_(randn(*pool.v_buffer[0].shape))
    order = torch.randperm(total, generator=cpu_gen) if shuffle_slots else torch.arange(total)
    slots = (1 + order).to(device)  # slot 0 is the padding slot
    req_pool = ReqToTokenPool(bs + 1, max(seq_lens, default=0) + 1, device)
    req_pool_indices = list(range(bs, 0, -1))
    new_slots, off = [], 0
    for idx, p, s in zip(req_pool_indices, prefix_lens, seq_lens):
        req_pool.req_to_token[idx, :s] = slots[off : off + s]
        new_slots.append(slots[off + p : off + s])
        off += s
    rows = sum(extend_lens)
    q, k, v = randn(rows, num_heads, head_dim), randn(rows, num_kv_heads, head_dim), randn(rows, num_kv_heads, head_dim)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(rows, dtype=torch.int64, device=device),
        req_pool_indices=tensor(req_pool_indices),
        seq_lens=tensor(seq_lens),
        out_cache_loc=torch.cat(new_slots) if new_slots else tensor([]),
        seq_lens_sum=total,
        positions=tensor([pos for p, s in zip(prefix_lens, seq_lens) for pos in range(p, s)]),
        seq_lens_cpu=seq_lens,
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
    )
    if not decode:
        fb.extend_num_tokens = rows
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(prefix_lens), list(extend_lens)
        fb.extend_prefix_lens, fb.extend_seq_lens = tensor(prefix_lens), tensor(extend_lens)
        fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    layer = RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, layer_id=0)
    return PagedAttentionCase(fb, layer, q, k, v)


def run_attention(backend: AttentionBackend, case: PagedAttentionCase) -> torch.Tensor:
    """One layer's attention of the case through ``backend``: [new rows, q_heads, head_dim]."""
    case.forward_batch.attn_backend = backend
    backend.init_forward_metadata(case.forward_batch)
    return backend.forward(case.q, case.k, case.v, case.layer, case.forward_batch)
