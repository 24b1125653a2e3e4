"""sglite against Hugging Face transformers on the real SmolLM2-135M-Instruct GGUF
(float32): logits, greedy continuations, the chat answer, and the CLI; and bfloat16
logits against transformers in bfloat16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglite.engine import Engine
from tests.helpers import HandScheduler

pytestmark = pytest.mark.real_model
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\nx = np.",
    "Ünïcödé and emoji 🚀 test:",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from sglite.model_loader.registry import resolve_smollm2_gguf

    return resolve_smollm2_gguf()


@pytest.fixture(scope="module")
def hf(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model.eval(), tok


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m", max_total_tokens=8192)


def test_logits_match_transformers(hf, engine):
    model, tok = hf
    runner = engine.scheduler.tp_worker.model_runner
    hs = HandScheduler(runner)
    for prompt in PROMPTS[:4]:
        ids = engine.tokenizer.encode(prompt)
        assert ids == tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        ours = hs.extend([(hs.new_seq(), ids)])
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-3, (prompt, diff)
    for idx in hs.tokens:
        runner.req_to_token_pool.free(idx)
    runner.token_to_kv_pool_allocator.clear()


def test_logprobs_match_transformers_log_softmax(hf, engine):
    """Prompt and output logprobs of a greedy request (the log-softmax of the raw
    logits, SGLang's) against transformers' on the same tokens; top tokens too.
    Measured on three prompts: max abs difference 3.4e-05, every position's top 5 the
    same tokens in the same order (docs/serving.md, "Logprobs")."""
    model, _ = hf
    out = engine.generate(PROMPTS[2], {"max_new_tokens": 8, "temperature": 0}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=5)
    meta = out["meta_info"]
    prompt = [t for _, t, _ in meta["input_token_logprobs"]]
    ids = prompt + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    ours = [v for v, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(ours, want)) <= 2e-4
    for pos, top in enumerate(meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]):
        values, token_ids = ref[pos].topk(5)
        assert max(abs(v - w) for (v, _, _), w in zip(top, values.tolist())) <= 2e-4
        assert [t for _, t, _ in top] == token_ids.tolist()


def test_bfloat16_logits_match_transformers_bfloat16(hf, gguf_path):
    """--dtype bfloat16 (packed linears, bfloat16 kernels and KV pool) on the prompts'
    every row: within 1.0 of transformers' bfloat16 logits (they are about 30 in size;
    measured up to 0.93), no farther from the float32 model than transformers' bfloat16
    run is (1.5x), and the same greedy token as the float32 model on every row whose
    top two float32 logits are more than 0.25 apart (bfloat16's rounding moves logits by
    up to about that; one row of these prompts is a 0.037 tie, which either token may win)."""
    model32, _ = hf
    model16 = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.bfloat16).eval()
    with Engine("smollm2-135m", max_total_tokens=2048, dtype="bfloat16") as engine:
        runner = engine.scheduler.tp_worker.model_runner
        assert runner.model.packed_lm_head is not None
        hs = HandScheduler(runner)
        for prompt in PROMPTS[:4]:
            ids = engine.tokenizer.encode(prompt)
            with torch.no_grad():
                r32 = model32(torch.tensor([ids])).logits[0]
                r16 = model16(torch.tensor([ids])).logits[0].float()
            ours = hs.extend([(hs.new_seq(), ids)])
            assert (ours - r16).abs().max().item() <= 1.0, prompt
            assert (ours - r32).abs().max().item() <= 1.5 * (r16 - r32).abs().max().item(), prompt
            top2 = r32.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.25
            assert torch.equal(ours.argmax(-1)[clear], r32.argmax(-1)[clear]), prompt


def test_greedy_continuations_match_transformers(hf, engine):
    model, tok = hf
    prompts = PROMPTS + [tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)]
    outs = engine.generate(prompts, sampling_params={"max_new_tokens": 20, "temperature": 0})
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
        assert out["output_ids"] == ref, prompt


@pytest.fixture(scope="module")
def chats_sharing_a_system_prompt(hf):
    """Four chats behind one long system prompt, and transformers' 16 greedy tokens for each."""
    model, tok = hf
    system = " ".join(["You are a careful assistant who answers in one short sentence."] * 12)
    questions = ["What is the capital of Italy?", "Name a primary color.", "What is 2 + 2?", "What color is the sky?"]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True) for q in questions]
    refs = []
    for prompt in prompts:
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            refs.append(model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                       pad_token_id=2)[0, len(ids):].tolist())
    return prompts, refs


SHARED_CHAT_PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def run_chats_after_one(engine: Engine, prompts: list[str]) -> list[dict]:
    """The first chat alone (its system prompt enters the radix cache), then all four."""
    engine.generate(prompts[0], sampling_params={"max_new_tokens": 1})
    return engine.generate(prompts, sampling_params=SHARED_CHAT_PARAMS)


def test_chats_sharing_a_system_prompt_match_transformers(chats_sharing_a_system_prompt, engine):
    """The CPU default (cpu backend, decode rounds as one C++ call) on chats whose system
    prompt is cached once: transformers' greedy tokens, and the prompt hit in the cache."""
    prompts, refs = chats_sharing_a_system_prompt
    outs = run_chats_after_one(engine, prompts)
    assert [o["output_ids"] for o in outs] == refs
    assert min(o["meta_info"]["cached_tokens"] for o in outs) > 100


def test_chats_sharing_a_system_prompt_torch_native_grouped(chats_sharing_a_system_prompt, monkeypatch):
    """torch_native's shared-prefix path (the cached system prompt attended to once for
    all the chats' decode rows) gives transformers' greedy tokens."""
    prompts, refs = chats_sharing_a_system_prompt
    engine = Engine("smollm2-135m", max_total_tokens=8192, attention_backend="torch_native")
    backend = engine.scheduler.tp_worker.model_runner.attn_backend
    grouped = []
    plan = backend.init_forward_metadata

    def spy(fb):  # noqa: ANN001
        plan(fb)
        grouped.append(sum(g.q_rows.numel() for g in backend._groups))

    monkeypatch.setattr(backend, "init_forward_metadata", spy)
    outs = run_chats_after_one(engine, prompts)
    engine.shutdown()
    assert max(grouped) == len(prompts)  # every chat's decode row read the prefix together
    assert [o["output_ids"] for o in outs] == refs


def test_chat_capital_of_france(engine):
    out = engine.generate(messages=CHAT, sampling_params={"max_new_tokens": 32, "temperature": 0})
    assert out["text"] == "The capital of France is Paris."
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


def test_cli_generate_chat():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "sglite.cli", "generate", "--chat", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."


def test_config_matches_the_model_card(engine):
    c = engine.scheduler.model_config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (1536, 49152, 100000.0, True)
    assert c.eos_token_ids == [2]


TRICKY = ["Hello world", "  leading spaces\n\ttabs", "naïve café — ‘quotes’ 🚀🚀", "x = [1, 2, 3]  # code",
          "<|im_start|>user\nhi<|im_end|>", "1234567890 3.14159", "日本語のテキスト"]


def test_tokenizer_and_chat_template_match_transformers(hf, engine):
    _, tok = hf
    for s in TRICKY:
        assert engine.tokenizer.encode(s) == tok.encode(s, add_special_tokens=False), s
        ids = tok.encode(s, add_special_tokens=False)
        assert engine.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    for msgs in (CHAT, [{"role": "system", "content": "Be brief."}, *CHAT]):
        assert engine.tokenizer.apply_chat_template(msgs) == tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)


def test_unpermuted_qk_equal_transformers_weights(hf, gguf_path):
    from sglite.model_loader import load_model

    model, _ = hf
    ours = load_model(str(gguf_path)).weights
    theirs = model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight"):
        assert (ours[name] - theirs[name]).abs().max().item() <= 1e-6, name
