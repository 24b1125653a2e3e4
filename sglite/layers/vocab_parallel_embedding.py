"""The embedding and the LM head cut by vocabulary rows (SGLang:
layers/vocab_parallel_embedding.py).

Under tensor parallelism each rank holds ``shard_size = ceil(vocab / tp)`` rows of the
table: rank r the token ids [r * shard_size, (r + 1) * shard_size), the last rank's
shard padded with zero rows so that every rank's part has one shape (the LM head's
all-gather needs that). A rank looks up the ids that fall in its shard, writes zeros
for the others, and an all-reduce sums the ranks' rows into every token's embedding.
The LM head computes the logits of its shard's tokens; LogitsProcessor all-gathers them
and drops the padding. At tp 1 the shard is the whole table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sglite.distributed.parallel_state import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                               tensor_model_parallel_all_reduce)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = get_tensor_model_parallel_world_size()
        self.shard_size = math.ceil(num_embeddings / self.tp_size)
        self.vocab_start = get_tensor_model_parallel_rank() * self.shard_size
        self.vocab_end = min(num_embeddings, self.vocab_start + self.shard_size)  # this rank's real rows end here
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """Keep this rank's rows of the full [vocab, hidden] table; padding rows are zero."""
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"{name}: shape {tuple(loaded.shape)} != {(self.num_embeddings, self.embedding_dim)}")
        rows = self.vocab_end - self.vocab_start
        self.weight.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        self.weight.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, dim={self.embedding_dim}"
                + (f", rows {self.vocab_start}..{self.vocab_end - 1} of {self.shard_size}" if self.tp_size > 1 else ""))


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same cut as the embedding (its weight is the rows of its
    shard's tokens); LogitsProcessor multiplies by it and gathers the ranks' logits."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head's weight is used by LogitsProcessor, not called")
