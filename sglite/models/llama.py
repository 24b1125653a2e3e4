"""LlamaForCausalLM for the Llama family: SmolLM2, Llama 2/3 (llama3 RoPE scaling),
Qwen2-style QKV bias; GQA; tied or untied embeddings (SGLang: models/llama.py).

Like SGLang, q/k/v are one fused ``qkv_proj`` and gate/up one ``gate_up_proj``;
``load_weights`` stacks the Hugging Face tensors into them."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from sglite.configs.model_config import ModelConfig
from sglite.layers.activation import SiluAndMul
from sglite.layers.layernorm import RMSNorm
from sglite.layers.linear import ReplicatedLinear
from sglite.layers.logits_processor import LogitsProcessor
from sglite.layers.radix_attention import RadixAttention
from sglite.layers.rotary_embedding import get_rope
from sglite.model_executor.forward_batch_info import ForwardBatch


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = ReplicatedLinear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = ReplicatedLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = ReplicatedLinear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = get_rope(
            self.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(
            positions, q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim)
        )
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, forward_batch)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # (fused parameter, Hugging Face name, shard index)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = None if config.tie_word_embeddings else ReplicatedLinear(
            config.hidden_size, config.vocab_size, bias=False
        )
        # the LM head as a packed layer (pack_linear_weights); a tied head packs a copy
        self.packed_lm_head: ReplicatedLinear | None = None
        self.logits_processor = LogitsProcessor()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_linear_weights(self) -> None:
        """Pack every linear layer and the LM head for the CPU's bfloat16 kernels (a
        bfloat16 model on a CPU, after its weights load); the embedding stays as it is."""
        for module in self.modules():
            if isinstance(module, ReplicatedLinear):
                module.pack()
        self.packed_lm_head = (self.lm_head if self.lm_head is not None
                               else ReplicatedLinear.packed_from(self.model.embed_tokens.weight))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.model(input_ids, positions, forward_batch)
        head = self.packed_lm_head if self.packed_lm_head is not None else self.lm_head_weight
        return self.logits_processor(hidden_states, head, forward_batch)

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            for fused, part, shard in self.stacked_params_mapping:
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    sizes = self._shard_sizes(fused)
                    off = sum(sizes[:shard])
                    param = params[target]
                    if w.shape[0] != sizes[shard]:
                        raise ValueError(f"{name}: shape {tuple(w.shape)} does not fit {fused} shard {shard}")
                    param.data[off : off + sizes[shard]].copy_(w)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name}")
                if params[name].shape != w.shape:
                    raise ValueError(f"{name}: shape {tuple(w.shape)} != {tuple(params[name].shape)}")
                params[name].data.copy_(w)
                loaded.add(name)
        missing = []
        for n in params:
            fused = next((f for f, _, _ in self.stacked_params_mapping if f".{f}." in n), None)
            want = [n] if fused is None else [f"{n}#{i}" for i in range(len(self._shard_sizes(fused)))]
            missing += [w for w in want if w not in loaded]
        if missing:
            raise ValueError(f"weights missing for: {', '.join(missing[:5])}")


EntryClass = LlamaForCausalLM
