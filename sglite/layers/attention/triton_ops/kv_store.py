"""Store the new rows' K and V into the paged KV pool: ``k_buffer[loc[i]] = k[i]``
(what ``MHATokenToKVPool.set_kv_buffer`` does with indexing, as one kernel for both)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglite.layers.fused_kernels import rows_per_program


@triton.jit
def _store_kv_cache_kernel(
    K, V, K_Buffer, V_Buffer, Loc,
    stride_kt, stride_vt, stride_kb, stride_vb, T,
    ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (rows < T) & (offs < ROW)
    slots = tl.load(Loc + rows, mask=rows < T, other=0).to(tl.int64)
    k = tl.load(K + rows * stride_kt + offs, mask=mask)
    v = tl.load(V + rows * stride_vt + offs, mask=mask)
    tl.store(K_Buffer + slots * stride_kb + offs, k.to(K_Buffer.dtype.element_ty), mask=mask)
    tl.store(V_Buffer + slots * stride_vb + offs, v.to(V_Buffer.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] with each token's heads contiguous."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


def store_kv_cache(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    block_t: int | None = None,
) -> None:
    """k, v: [tokens, kv_heads, head_dim]; buffers: [slots, kv_heads, head_dim]; loc: [tokens]."""
    k, v, loc = _rows(k), _rows(v), loc.contiguous()
    n = k.shape[0]
    row = k.shape[1] * k.shape[2]
    block = min(1024, triton.next_power_of_2(row))
    block_t = block_t or rows_per_program(k.device)
    if n:
        _store_kv_cache_kernel[(triton.cdiv(n, block_t), triton.cdiv(row, block))](
            k, v, k_buffer, v_buffer, loc,
            k.stride(0), v.stride(0), k_buffer.stride(0), v_buffer.stride(0), n,
            ROW=row, BLOCK_T=block_t, BLOCK=block, num_warps=4,
        )
