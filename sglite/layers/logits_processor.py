"""LogitsProcessor: hidden states -> logits, only for the rows that are sampled
(SGLang: layers/logits_processor.py). In an extend batch that is each request's last
row: tutorial A's 9 prefill rows (docs/seeds.md §A3) give 2 rows of logits.

The head is the LM head's weight [vocab, hidden] (logits = hidden @ weight.T, in the
model's dtype, then float32), or a packed ``ReplicatedLinear`` (a model on the cpu
backend), whose float32 sums are the logits without a bfloat16 rounding between.

Under tensor parallelism each rank's head holds a shard of the vocabulary
(layers/vocab_parallel_embedding.py): the ranks' logits are all-gathered, side by side
in rank order, and the padding of the last shard is dropped, so every rank returns the
full [rows, vocab] logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from sglite.distributed.parallel_state import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

if TYPE_CHECKING:
    from sglite.layers.linear import ReplicatedLinear
    from sglite.model_executor.forward_batch_info import ForwardBatch


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = get_tensor_model_parallel_world_size()

    def forward(
        self, hidden_states: torch.Tensor, lm_head: "torch.Tensor | ReplicatedLinear", forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_extend() and not forward_batch.return_all_logits:
            last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            hidden_states = hidden_states[last]
        if isinstance(lm_head, torch.Tensor):
            logits = torch.matmul(hidden_states, lm_head.t()).float()
        else:
            logits = lm_head(hidden_states, out_float32=True)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits)[:, : self.vocab_size]
