"""LogitsProcessor: hidden states -> logits, only for the rows that are sampled
(SGLang: layers/logits_processor.py). In an extend batch that is each request's last
row: tutorial A's 9 prefill rows (docs/seeds.md §A3) give 2 rows of logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglite.model_executor.forward_batch_info import ForwardBatch


class LogitsProcessor(nn.Module):
    def forward(
        self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_extend() and not forward_batch.return_all_logits:
            last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            hidden_states = hidden_states[last]
        return torch.matmul(hidden_states, lm_head_weight.t()).float()
