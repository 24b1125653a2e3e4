"""``tiny-random``: a seeded random-weight llama (about 1 MB) with a real byte-level
BPE tokenizer trained in-process, for fast tests of everything but model quality.

Its logits are deliberately well separated (a large lm_head scale), so greedy
decoding does not flip on the last-bit floating-point differences that batching can
cause, and EOS is never the argmax (its lm_head row is zero), so generations run to
max_new_tokens unless a test asks otherwise.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sglite.configs.model_config import ModelConfig
from sglite.model_loader.tokenizer import Tokenizer

SEED = 0
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """\
The scheduler keeps a waiting queue and a running batch. Every round it asks which
requests can run, how many tokens each one still has to compute, and whether the key
value cache has room for them. A request that shares a prefix with an earlier one
reuses the cached keys and values, so only the new tokens are computed. When the pool
runs short, the scheduler retracts the request with the fewest decoded tokens and puts
it back in the queue; it will be prefilled again later and continue where it stopped.
Long prompts are cut into chunks, and each chunk takes one round, so that decoding
requests are not starved. The quick brown fox jumps over the lazy dog. What is the
capital of France? The capital of France is Paris. Numbers like 0 1 2 3 4 5 6 7 8 9
and 2026, symbols such as + - * / = < > ( ) [ ] { } and code: def f(x): return x + 1.
"""


def build_tokenizer() -> Tokenizer:
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    eos = tk.token_to_id("<|im_end|>")
    return Tokenizer(tk, [eos], None, False, CHAT_TEMPLATE)


def tiny_config(vocab_size: int, eos: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_ids=[eos], name="tiny-random",
    )


@lru_cache(maxsize=1)
def _build() -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    tok = build_tokenizer()
    cfg = tiny_config(tok.vocab_size, tok.eos_token_ids[0])
    g = torch.Generator().manual_seed(SEED)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(cfg.vocab_size, h, std=1.0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(h, h, std=h**-0.5 * 2)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h, std=h**-0.5 * 2)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = rand(h, h, std=h**-0.5)
        w[p + "mlp.gate_proj.weight"] = rand(cfg.intermediate_size, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = rand(cfg.intermediate_size, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = rand(h, cfg.intermediate_size, std=cfg.intermediate_size**-0.5)
        w[p + "input_layernorm.weight"] = 1 + rand(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(h, std=0.1)
    w["model.norm.weight"] = torch.ones(h)
    head = rand(cfg.vocab_size, h, std=1.5)  # logit std ~12: near-ties are rare
    head[cfg.eos_token_ids[0]] = 0.0
    w["lm_head.weight"] = head
    return cfg, w, tok


def build_tiny_random() -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    return _build()
