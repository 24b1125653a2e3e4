"""LogitsProcessor: hidden states -> logits, only for the rows that are sampled
(SGLang: layers/logits_processor.py). In an extend batch that is each request's last
row: tutorial A's 9 prefill rows (docs/seeds.md §A3) give 2 rows of logits.

The head is the LM head's weight [vocab, hidden] (logits = hidden @ weight.T, in the
model's dtype, then float32), or a packed ``ReplicatedLinear`` (a bfloat16 model on a
CPU), whose float32 sums are the logits without a bfloat16 rounding between."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglite.layers.linear import ReplicatedLinear
    from sglite.model_executor.forward_batch_info import ForwardBatch


class LogitsProcessor(nn.Module):
    def forward(
        self, hidden_states: torch.Tensor, lm_head: "torch.Tensor | ReplicatedLinear", forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_extend() and not forward_batch.return_all_logits:
            last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            hidden_states = hidden_states[last]
        if isinstance(lm_head, torch.Tensor):
            return torch.matmul(hidden_states, lm_head.t()).float()
        return lm_head(hidden_states, out_float32=True)
