"""ModelRunner on the tiny model with hand-built batches over the real paged pools.
Rows agree to float32 rounding (the logits are ~10 in scale, batching changes the
last bits of the matmuls)."""

from __future__ import annotations

import torch

from sglite.model_executor.forward_batch_info import ForwardMode
from sglite.model_executor.model_runner import ModelRunner
from sglite.server_args import ServerArgs
from tests.helpers import HandScheduler


def runner() -> ModelRunner:
    return ModelRunner(ServerArgs(model_path="tiny-random", max_total_tokens=256, max_running_requests=8))


def alone(tokens: list[int]) -> torch.Tensor:
    hs = HandScheduler(runner())
    return hs.extend([(hs.new_seq(), tokens)])


def test_seed_batch_rows_equal_each_request_alone():
    """R1 prefills 6 rows; R2 has 3 tokens in the pool and extends 3 (docs/seeds.md §A3)."""
    r1, r2 = [21, 22, 23, 24, 25, 26], [11, 12, 13, 31, 32, 33]
    hs = HandScheduler(runner())
    warm, a, b = hs.new_seq(), hs.new_seq(), hs.new_seq()
    hs.extend([(warm, r2[:3])])
    hs.share_prefix(warm, b, 3)
    logits = hs.extend([(a, r1), (b, r2[3:])])
    assert logits.shape[0] == 9
    torch.testing.assert_close(logits[:6], alone(r1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(logits[6:], alone(r2)[3:], rtol=1e-5, atol=1e-4)


def test_decode_after_extend_equals_one_longer_extend():
    prompt, nxt = [5, 6, 7, 8, 9, 10], 42
    hs = HandScheduler(runner())
    a, b = hs.new_seq(), hs.new_seq()
    hs.extend([(a, prompt), (b, prompt[:4])])
    dec = hs.decode([(a, nxt), (b, prompt[4])])
    longer = alone(prompt + [nxt])[-1]
    torch.testing.assert_close(dec[0], longer, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dec[1], alone(prompt[:5])[-1], rtol=1e-5, atol=1e-4)


def test_mixed_mode_runs_decode_rows_as_one_token_extends():
    prompt = [5, 6, 7, 8]
    hs = HandScheduler(runner())
    a, b = hs.new_seq(), hs.new_seq()
    hs.extend([(a, prompt)])
    # b prefills 4 rows while a decodes one, in one MIXED forward
    out = hs.extend([(b, [9, 10, 11, 12]), (a, [13])], mode=ForwardMode.MIXED)
    torch.testing.assert_close(out[4], alone(prompt + [13])[-1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[:4], alone([9, 10, 11, 12]), rtol=1e-5, atol=1e-4)


def test_pool_sized_from_max_total_tokens_or_memory():
    r = runner()
    assert r.max_total_num_tokens == 256 and r.token_to_kv_pool_allocator.available_size() == 256
    auto = ModelRunner(ServerArgs(model_path="tiny-random"))
    assert auto.max_total_num_tokens > 256 and auto.max_total_num_tokens == auto.token_to_kv_pool.size
