"""The triton backend in the whole model: tiny-random logits with
attention_backend="triton" (Triton attention and the fused RMSNorm / SiLU-and-mul /
RoPE kernels) equal torch_native's, in float32; greedy generations through the Engine
are the same; and the errors a CPU user sees."""

from __future__ import annotations

import pytest
import torch

from sglite import Engine
from sglite.layers.custom_op import CustomOp
from sglite.model_executor.forward_batch_info import ForwardMode
from sglite.model_executor.model_runner import ModelRunner, _cpu_ops_unavailable, resolve_attention_backend
from sglite.server_args import ServerArgs
from tests.helpers import HandScheduler

LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-4}  # logits ~40 in scale, float32


def runner(backend: str, **kw) -> ModelRunner:
    # a 256-token context: one KV split of 256 positions per row in deterministic mode
    # (fewer programs for the interpreter); test_triton_invariance.py crosses splits
    kw.setdefault("context_length", 256)
    return ModelRunner(ServerArgs(model_path="tiny-random", max_total_tokens=256, max_running_requests=8,
                                  attention_backend=backend, **kw))


A_PROMPT = list(range(5, 75))  # 70 tokens: past a KV block of 64 and a split tile of 64


def seed_rounds(backend: str, **kw) -> list[torch.Tensor]:
    """Every row's logits of: a prefill; an extend batch mixing prefix 0 and a 13-token
    shared prefix; a MIXED batch; two decode rounds."""
    hs = HandScheduler(runner(backend, **kw))
    warm, a, b, c = hs.new_seq(), hs.new_seq(), hs.new_seq(), hs.new_seq()
    out = [hs.extend([(warm, list(range(10, 30)))])]
    hs.share_prefix(warm, b, 13)
    out.append(hs.extend([(a, A_PROMPT), (b, [40, 41, 42, 43])]))
    out.append(hs.extend([(c, [60, 61, 62]), (a, [12])], mode=ForwardMode.MIXED))
    out.append(hs.decode([(a, 1), (b, 2), (warm, 3), (c, 4)]))
    out.append(hs.decode([(a, 5), (b, 6), (warm, 7), (c, 8)]))
    return out


def test_triton_runner_uses_triton_everywhere():
    r = runner("triton")
    assert r.attn_backend.name == "triton"
    assert all(m.impl == "triton" for m in r.model.modules() if isinstance(m, CustomOp))
    assert all(m.impl == "native" for m in runner("torch_native").model.modules() if isinstance(m, CustomOp))


def test_model_logits_equal_torch_native():
    for got, want in zip(seed_rounds("triton"), seed_rounds("torch_native"), strict=True):
        torch.testing.assert_close(got, want, **LOGITS_TOL)


@pytest.mark.skipif(torch.cuda.is_available() or bool(_cpu_ops_unavailable()),
                    reason="CPU only, with its C++ packed linears: cuBLAS's are not batch-invariant (docs/kernels.md)")
@pytest.mark.parametrize("tile", [64, 256])  # 64: a's 70 tokens cross a split (two, in a 128-token context)
def test_deterministic_triton_gives_a_request_its_solo_logits_bit_for_bit(tile):
    """Request a's rows among other requests (prefill, MIXED, decode) and alone: every
    logit equal."""
    kw = {"triton_attention_split_tile_size": tile, "context_length": 128 if tile == 64 else 256}
    batched = seed_rounds("triton", **kw)
    hs = HandScheduler(runner("triton", **kw))
    a = hs.new_seq()
    solo = [hs.extend([(a, A_PROMPT)]), hs.extend([(a, [12])]), hs.decode([(a, 1)]), hs.decode([(a, 5)])]
    assert torch.equal(solo[0], batched[1][: len(A_PROMPT)])
    assert torch.equal(solo[1][0], batched[2][3])
    assert torch.equal(solo[2][0], batched[3][0]) and torch.equal(solo[3][0], batched[4][0])


def test_engine_greedy_generation_equal_torch_native():
    """Two rounds so the second reuses cached prefixes (extend with prefix > 0)."""
    first = ["The quick brown fox", "What is the capital of France?", "def f(x):"]
    second = ["The quick brown fox jumps over", "What is the capital of Paris?"]
    params = {"max_new_tokens": 5, "temperature": 0}

    def generate(backend: str) -> list[list[int]]:
        engine = Engine("tiny-random", attention_backend=backend, max_total_tokens=512, context_length=256)
        outs = engine.generate(first, params) + engine.generate(second, params)
        engine.shutdown()
        return [o["output_ids"] for o in outs]

    assert generate("triton") == generate("torch_native")


def test_auto_backend_is_triton_on_cuda():
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for CPU machines")
def test_triton_on_cpu_without_interpreter_is_a_one_line_value_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1 .* or use --attention-backend torch_native") as err:
        runner("triton")
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for CPU machines")
def test_kernels_imported_before_the_interpreter_was_on_are_reported(monkeypatch):
    from sglite.layers.attention.triton_ops import decode_attention

    monkeypatch.setattr(decode_attention, "_decode_grouped_stage1", object())
    with pytest.raises(ValueError, match="imported before TRITON_INTERPRET=1 was set"):
        runner("triton")
