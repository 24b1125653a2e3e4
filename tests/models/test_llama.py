"""LlamaForCausalLM against Hugging Face transformers on random tiny configs:
plain Llama with GQA, Qwen2-style QKV bias, llama3 RoPE scaling, untied head."""

from __future__ import annotations

import pytest
import torch

from sglite.configs.model_config import ModelConfig
from sglite.model_executor.model_runner import ModelRunner
from sglite.server_args import ServerArgs
from tests.helpers import HandScheduler

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=256, rope_theta=10000.0)

CASES = {
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3-rope-scaling": ("llama", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
}


def _hf_model(arch: str, extra: dict):
    torch.manual_seed(0)
    kw = {**BASE, **extra}
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms and biases, so a skipped one shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval(), ModelConfig(
        architecture=arch, head_dim=BASE["hidden_size"] // kw["num_attention_heads"],
        attention_bias=arch == "qwen2", **{k: v for k, v in kw.items() if k in ModelConfig.__dataclass_fields__},
    )


def _runner(cfg: ModelConfig, weights: dict) -> ModelRunner:
    args = ServerArgs(model_path="unused", device="cpu", max_total_tokens=512, max_running_requests=8)
    return ModelRunner(args, cfg, weights)


@pytest.mark.parametrize("case", list(CASES))
def test_extend_logits_match_transformers(case):
    arch, extra = CASES[case]
    hf, cfg = _hf_model(arch, extra)
    runner = _runner(cfg, hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    hs = HandScheduler(runner)
    ours = hs.extend([(hs.new_seq(), ids)])
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["llama-gqa-tied", "qwen2-bias"])
def test_mixed_prefix_batch_and_decode_match_transformers(case):
    """R1 prefills 6 rows; R2 has 3 cached tokens and extends 3 (docs/seeds.md §A3); both then
    decode one token at position 6 (§4). Every row equals the model run alone."""
    arch, extra = CASES[case]
    hf, cfg = _hf_model(arch, extra)
    runner = _runner(cfg, hf.state_dict())
    r1 = [5, 17, 33, 2, 8, 41]
    r2 = [5, 17, 33, 60, 61, 62]
    hs = HandScheduler(runner)
    warm, a, b = hs.new_seq(), hs.new_seq(), hs.new_seq()
    hs.extend([(warm, r2[:3])])
    hs.share_prefix(warm, b, 3)
    logits = hs.extend([(a, r1), (b, r2[3:])])
    assert logits.shape[0] == 9
    with torch.no_grad():
        ref1 = hf(torch.tensor([r1])).logits[0]
        ref2 = hf(torch.tensor([r2])).logits[0]
    assert (logits[:6] - ref1).abs().max() < 1e-4
    assert (logits[6:] - ref2[3:]).abs().max() < 1e-4
    t1, t2 = 70, 71
    dec = hs.decode([(a, t1), (b, t2)])
    with torch.no_grad():
        ref1 = hf(torch.tensor([r1 + [t1]])).logits[0, -1]
        ref2 = hf(torch.tensor([r2 + [t2]])).logits[0, -1]
    assert (dec[0] - ref1).abs().max() < 1e-4
    assert (dec[1] - ref2).abs().max() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_logits_match_transformers_bfloat16(case):
    """--dtype bfloat16 on a CPU (packed linears, the bfloat16 kernels, the CPU graph for
    the decode row) against transformers in bfloat16: logits within 0.01 of it (logits
    here are about 1 in size; bfloat16 keeps 8 bits), and no farther from the float32
    model than transformers' own bfloat16 run is (1.5x, or 1e-3)."""
    import copy

    arch, extra = CASES[case]
    hf, cfg = _hf_model(arch, extra)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    args = ServerArgs(model_path="unused", device="cpu", max_total_tokens=512, max_running_requests=8,
                      dtype="bfloat16")
    runner = ModelRunner(args, cfg, hf.state_dict())
    assert runner.model.packed_lm_head is not None and runner.cpu_graph_runner is not None
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    hs = HandScheduler(runner)
    seq = hs.new_seq()
    ours = [hs.extend([(seq, ids)]), hs.decode([(seq, 7)])[0]]
    with torch.no_grad():
        ref32 = [hf(torch.tensor([ids])).logits[0], hf(torch.tensor([ids + [7]])).logits[0, -1]]
        ref16 = [hf16(torch.tensor([ids])).logits[0].float(), hf16(torch.tensor([ids + [7]])).logits[0, -1].float()]
    for o, r16, r32 in zip(ours, ref16, ref32):
        assert o.dtype == torch.float32 and o.shape == r16.shape
        assert (o - r16).abs().max().item() < 0.01
        assert (o - r32).abs().max().item() <= max(1.5 * (r16 - r32).abs().max().item(), 1e-3)
