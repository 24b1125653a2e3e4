"""Sampler: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds,
each row with its own parameters in one batch."""

from __future__ import annotations

import torch

from sglite.layers.sampler import Sampler, top_k_top_p_min_p_renorm
from sglite.managers.schedule_batch import Req
from sglite.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.sampling.sampling_params import SamplingParams

VOCAB = 8


def make_req(seed: int = 0, output_ids=(), prompt=(1,), **params) -> Req:
    sp = SamplingParams(**params)
    sp.normalize()
    req = Req("r", None, list(prompt), sp, seed=seed)
    req.output_ids = list(output_ids)
    return req


def info(*reqs: Req) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(list(reqs), VOCAB, "cpu")


LOGITS = torch.tensor([[0.0, 3.0, 2.5, 1.0, -1.0, 0.5, 2.9, -2.0]])


def test_greedy_is_argmax_and_temperature_zero_means_greedy():
    r = make_req(temperature=0.0)
    assert r.sampling_params.top_k == 1
    assert Sampler()(LOGITS, info(r)).tolist() == [1]


def test_top_k_top_p_min_p_masks():
    probs = torch.softmax(LOGITS, -1)
    k = top_k_top_p_min_p_renorm(probs, torch.tensor([[3]]), torch.tensor([[1.0]]), None)
    assert set(torch.nonzero(k[0]).flatten().tolist()) == {1, 2, 6}
    assert torch.allclose(k.sum(), torch.tensor(1.0))
    # nucleus: smallest set whose mass reaches top_p, the crossing token included
    sorted_p, order = probs[0].sort(descending=True)
    p = float(sorted_p[:2].sum()) - 1e-4
    nucleus = top_k_top_p_min_p_renorm(probs, torch.tensor([[1 << 30]]), torch.tensor([[p]]), None)
    assert set(torch.nonzero(nucleus[0]).flatten().tolist()) == set(order[:2].tolist())
    mp = top_k_top_p_min_p_renorm(probs, torch.tensor([[1 << 30]]), torch.tensor([[1.0]]), torch.tensor([[0.5]]))
    keep = probs[0] >= 0.5 * probs[0].max()
    assert (mp[0] > 0).tolist() == keep.tolist()


def test_sampling_stays_inside_the_allowed_set():
    seen = set()
    for seed in range(200):
        r = make_req(seed=seed, temperature=1.0, top_k=3)
        seen.add(Sampler()(LOGITS, info(r)).item())
    assert seen == {1, 2, 6}


def test_seeded_rows_are_independent_of_the_batch():
    alone = [Sampler()(LOGITS, info(make_req(seed=5, temperature=1.0))).item() for _ in range(1)]
    a = make_req(seed=5, temperature=1.0)
    b = make_req(seed=9, temperature=0.7, top_p=0.9)
    c = make_req(temperature=0.0)
    batch = Sampler()(LOGITS.repeat(3, 1), info(b, a, c)).tolist()
    assert batch[1] == alone[0]
    assert batch[2] == 1  # the greedy row stays greedy next to sampled ones


def test_penalties():
    r = make_req(output_ids=[1, 1, 2], prompt=[6], frequency_penalty=0.5, presence_penalty=0.25,
                 repetition_penalty=2.0)
    out = info(r).apply_penalties(LOGITS.clone())
    exp = LOGITS.clone()
    exp[0, 1] = (3.0 - 2 * 0.5 - 0.25) / 2.0
    exp[0, 2] = (2.5 - 0.5 - 0.25) / 2.0
    exp[0, 6] = 2.9 / 2.0  # prompt token: repetition penalty only
    assert torch.allclose(out, exp)
    neg = make_req(output_ids=[4], repetition_penalty=2.0)
    assert info(neg).apply_penalties(LOGITS.clone())[0, 4].item() == -2.0


def test_min_new_tokens_masks_eos_and_stop_tokens_until_reached_then_logit_bias_adds():
    """SGLang's order: penalties, min_new_tokens' mask (EOS and stop_token_ids -inf while
    the output is short of it), then logit_bias; each row its own."""
    short = make_req(output_ids=[3], min_new_tokens=2, stop_token_ids=[6], max_new_tokens=8, temperature=0)
    short.eos_token_ids = {1}
    done = make_req(output_ids=[3, 3], min_new_tokens=2, stop_token_ids=[6], max_new_tokens=8, temperature=0)
    done.eos_token_ids = {1}
    biased = make_req(logit_bias={"4": 10.0, "1": -3.5}, temperature=0)
    out = info(short, done, biased).apply_logits_bias(LOGITS.repeat(3, 1))
    assert out[0, 1] == float("-inf") and out[0, 6] == float("-inf") and out[0, 2] == 2.5
    assert torch.equal(out[1], LOGITS[0])
    assert out[2, 4].item() == 9.0 and out[2, 1].item() == -0.5 and out[2, 2].item() == 2.5
    assert Sampler()(LOGITS.repeat(3, 1), info(short, done, biased)).tolist() == [2, 1, 4]
