"""Sampler: logits -> next token ids, each row with its own parameters and random
stream (SGLang: layers/sampler.py)."""

from __future__ import annotations

import torch
from torch import nn

from sglite.sampling.sampling_batch_info import SamplingBatchInfo


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        return self.sample(self.penalized(logits, sampling_info), sampling_info)

    @staticmethod
    def penalized(logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """The float32 logits the sampler draws from: penalties, min_new_tokens and
        logit_bias applied."""
        return sampling_info.apply_logits_bias(logits.float())

    @staticmethod
    def logprobs(penalized: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """Each row's logprobs as SGLang returns them for the sampled token: the
        log-softmax of the penalized logits over the temperature, before top-k, top-p
        and min-p (a greedy row's temperature is 1). Row by row: the same bits in any
        batch."""
        return torch.log_softmax(penalized / sampling_info.temperatures, dim=-1)

    def sample(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """Token ids from penalized logits (``penalized``)."""
        if sampling_info.is_all_greedy:
            return torch.argmax(logits, dim=-1)
        probs = torch.softmax(logits / sampling_info.temperatures, dim=-1)
        probs = top_k_top_p_min_p_renorm(
            probs, sampling_info.top_ks, sampling_info.top_ps,
            sampling_info.min_ps if sampling_info.need_min_p_sampling else None,
        )
        # One uniform draw per row, a function of the request's seed and the position of
        # the token it samples: the same tokens whatever else is in the batch.
        u = sampling_info.uniforms.to(probs.dtype)
        cdf = torch.cumsum(probs, dim=-1)
        ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        ids = ids.clamp_(max=probs.shape[-1] - 1)
        greedy_rows = sampling_info.top_ks.view(-1) == 1
        if greedy_rows.any():
            ids = torch.where(greedy_rows, torch.argmax(logits, dim=-1), ids)
        return ids


def top_k_top_p_min_p_renorm(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor | None
) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    drop = rank >= top_ks
    # keep the smallest set whose mass reaches top_p (the token crossing it stays)
    drop |= (sorted_p.cumsum(-1) - sorted_p) >= top_ps
    if min_ps is not None:
        drop |= sorted_p < sorted_p[:, :1] * min_ps
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)
