"""Linear layers (SGLang: layers/linear.py).

``ReplicatedLinear`` holds the whole weight. Under tensor parallelism (``--tp-size``,
sglite/distributed/) each rank holds a shard: ``ColumnParallelLinear`` cuts the output
features (``MergedColumnParallelLinear`` cuts each of gate and up, ``QKVParallelLinear``
takes the rank's query and KV heads, distributed/utils.py ``head_shard``), and
``RowParallelLinear`` cuts the input features and sums the ranks' partial outputs with
an all-reduce. A column-parallel layer followed by a row-parallel one needs no
communication between them: Llama's qkv -> attention -> o_proj and gate_up -> SiLU ->
down each end in one all-reduce. At tp 1 every class is a plain linear layer.

Each class's ``weight_loader`` takes the checkpoint's full tensor and copies this rank's
part of it (the model loads the whole checkpoint on every rank, then keeps its shard).

On a CPU with sglite's C++ kernels (bfloat16 or float32), ``pack()`` (called once after
the weights load, as SGLang's ``process_weights_after_loading`` does) replaces the
weight by its packed form (``convert_weight_packed``: blocks of 16 output rows; in
bfloat16 K in pairs, the layout AVX512-BF16's dot product reads) and ``forward`` runs
``weight_packed_linear``: float32 sums, each added in k order whatever the batch (batch
invariance), one pass over the weight for a batch of one. Everywhere else it is
``F.linear``. A rank packs its own shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglite.distributed.parallel_state import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                               tensor_model_parallel_all_reduce)
from sglite.distributed.utils import HeadShard, head_shard, split_range


class LinearBase(nn.Module):
    """y = x @ W.T + b over this rank's weight [output_size, input_size] (local sizes)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        # packed: weight is [output_size rounded up to 16, input_size rounded up to 2]
        self.packed = False

    def pack(self) -> None:
        """Pack a bfloat16 or float32 CPU weight for ``weight_packed_linear`` (once; the
        C++ kernels must load)."""
        if self.packed:
            return
        if self.weight.device.type != "cpu" or self.weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"packing needs a bfloat16 or float32 CPU weight, not {self.weight.dtype} on "
                             f"{self.weight.device}")
        from sglite.layers.cpu_ops import load_cpu_ops

        self.weight = nn.Parameter(load_cpu_ops().convert_weight_packed(self.weight.data), requires_grad=False)
        self.packed = True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, out_float32: bool = False) -> torch.Tensor:
        if self.packed:
            from sglite.layers.cpu_ops import load_cpu_ops

            return load_cpu_ops().weight_packed_linear(x, self.weight, bias, self.output_size, out_float32)
        out = F.linear(x, self.weight, bias)
        return out.float() if out_float32 else out

    def forward(self, x: torch.Tensor, out_float32: bool = False) -> torch.Tensor:
        """x @ W.T + b; ``out_float32`` returns the float32 sums (logits) instead of x's dtype."""
        return self.matmul(x, self.bias, out_float32)

    def extra_repr(self) -> str:
        tp = f", tp {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
                + (f", packed {'bf16' if self.weight.dtype == torch.bfloat16 else 'f32'}" if self.packed else "") + tp)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    @classmethod
    def packed_from(cls, weight: torch.Tensor) -> "ReplicatedLinear":
        """A packed layer over a copy of ``weight`` [out, in] (a tied LM head's embedding)."""
        layer = cls(weight.shape[1], weight.shape[0])
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
        layer.pack()
        return layer

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        _copy(getattr(self, name), loaded, name)


class ColumnParallelLinear(LinearBase):
    """The output features cut across the ranks; each rank's output is its slice (the
    next layer, row-parallel, takes it as its input shard)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        self.full_output_size = output_size
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.output_start, local = split_range(output_size, tp, rank)
        super().__init__(input_size, local, bias)

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int, int, int]:
        """(rows of the full tensor: how many it has, the first to keep, how many; where
        they go in this rank's weight)."""
        return self.full_output_size, self.output_start, self.output_size, 0

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        full, start, size, dest = self.shard_rows(shard_id)
        what = name if shard_id is None else f"{name} (part {shard_id})"
        if loaded.shape[0] != full:
            raise ValueError(f"{what}: shape {tuple(loaded.shape)} does not have the {full} rows this layer takes")
        _copy(getattr(self, name).data.narrow(0, dest, size), loaded.narrow(0, start, size), what, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (Llama's gate_up_proj): each is cut
    on its own, so a rank holds [its gate rows, its up rows]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.output_sizes = list(output_sizes)
        self.shards = [split_range(n, tp, rank) for n in output_sizes]
        LinearBase.__init__(self, input_size, sum(size for _, size in self.shards), bias)
        self.full_output_size = sum(output_sizes)

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int, int, int]:
        assert isinstance(shard_id, int), "a merged linear loads one output at a time"
        start, size = self.shards[shard_id]
        return self.output_sizes[shard_id], start, size, sum(s for _, s in self.shards[:shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight; a rank holds its query heads and their KV
    heads (``head_shard``): [its q rows, its k rows, its v rows]."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.head_dim = head_dim
        self.heads: HeadShard = head_shard(total_num_heads, total_num_kv_heads, tp, rank)
        self.q_size = self.heads.num_heads * head_dim
        self.kv_size = self.heads.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias)
        self.total_q_size, self.total_kv_size = total_num_heads * head_dim, total_num_kv_heads * head_dim
        self.full_output_size = self.total_q_size + 2 * self.total_kv_size

    def shard_rows(self, shard_id: int | str | None) -> tuple[int, int, int, int]:
        d, h, q, kv = self.head_dim, self.heads, self.q_size, self.kv_size
        return {"q": (self.total_q_size, h.q_start * d, q, 0),
                "k": (self.total_kv_size, h.kv_start * d, kv, q),
                "v": (self.total_kv_size, h.kv_start * d, kv, q + kv)}[str(shard_id)]


class RowParallelLinear(LinearBase):
    """The input features cut across the ranks (``input_shard``: (start, size) of this
    rank's, by default an even cut); every rank computes a partial sum of the whole
    output and ``reduce_results`` all-reduces them. The bias is added once, after."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_shard: tuple[int, int] | None = None, reduce_results: bool = True):
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.full_input_size = input_size
        self.input_start, local = input_shard or split_range(input_size, tp, rank)
        self.reduce_results = reduce_results
        super().__init__(local, output_size, bias)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if name == "bias":
            _copy(self.bias, loaded, name)
            return
        if loaded.dim() != 2 or loaded.shape[1] != self.full_input_size:
            raise ValueError(f"{name}: shape {tuple(loaded.shape)} does not have the {self.full_input_size} "
                             f"columns this layer takes")
        _copy(self.weight, loaded.narrow(1, self.input_start, self.input_size), name, loaded)

    def forward(self, x: torch.Tensor, out_float32: bool = False) -> torch.Tensor:
        if self.tp_size == 1 or not self.reduce_results:
            return self.matmul(x, self.bias, out_float32)
        out = tensor_model_parallel_all_reduce(self.matmul(x, None, out_float32))
        return out if self.bias is None else out + self.bias


def _copy(dest: torch.Tensor, part: torch.Tensor, what: str, full: torch.Tensor | None = None) -> None:
    if dest.shape != part.shape:
        shape = tuple((full if full is not None else part).shape)
        raise ValueError(f"{what}: shape {shape} does not fit this layer's {tuple(dest.shape)}")
    dest.data.copy_(part)
