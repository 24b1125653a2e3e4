"""LlamaForCausalLM for the Llama family: SmolLM2, Llama 2/3 (llama3 RoPE scaling),
Qwen2-style QKV bias; GQA; tied or untied embeddings (SGLang: models/llama.py).

Like SGLang, q/k/v are one fused ``qkv_proj`` and gate/up one ``gate_up_proj``;
``load_weights`` stacks the Hugging Face tensors into them. The layers are the
tensor-parallel ones (layers/linear.py, layers/vocab_parallel_embedding.py): at
``--tp-size N`` each rank builds the same model with its shard of every weight, and
each decoder layer does two all-reduces (after o_proj, after down_proj)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from sglite.configs.model_config import ModelConfig
from sglite.layers.activation import SiluAndMul
from sglite.layers.layernorm import RMSNorm
from sglite.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                  RowParallelLinear)
from sglite.layers.logits_processor import LogitsProcessor
from sglite.layers.radix_attention import RadixAttention
from sglite.layers.rotary_embedding import get_rope
from sglite.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.model_executor.forward_batch_info import ForwardBatch


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        # each rank: its slice of the intermediate features (gate and up alike), then a
        # partial down projection summed over the ranks
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.head_dim = config.head_dim
        # this rank's query heads and their KV heads (all of them at tp 1)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # o_proj's input features are the heads' outputs: a rank holds the columns of its heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        input_shard=(heads.q_start * self.head_dim, self.q_size))
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
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
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
    # (fused parameter, Hugging Face name, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size)
        # the LM head as a packed layer (pack_linear_weights), over a copy of its weight
        self.packed_lm_head: ReplicatedLinear | None = None
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_linear_weights(self) -> None:
        """Pack every linear layer and the LM head for the CPU's kernels (a bfloat16 or
        float32 model on the cpu backend, after its weights load); the embedding stays as
        it is."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.pack()
        self.packed_lm_head = ReplicatedLinear.packed_from(self.lm_head_weight)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.model(input_ids, positions, forward_batch)
        head = self.packed_lm_head if self.packed_lm_head is not None else self.lm_head_weight
        return self.logits_processor(hidden_states, head, forward_batch)

    def _shard_ids(self, fused: str) -> list[int | str]:
        return [shard for f, _, shard in self.stacked_params_mapping if f == fused]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Each Hugging Face tensor goes to its layer's ``weight_loader``, which keeps this
        rank's part (q/k/v and gate/up into their fused layer); every parameter must be
        loaded, every part of a fused one."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, shard = name, None
            for fused, part, shard_id in self.stacked_params_mapping:
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), shard_id
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name}")
            module_name, param_name = target.rsplit(".", 1)
            loader = getattr(modules[module_name], "weight_loader", None)
            if loader is not None:
                loader(param_name, w, shard)
            elif params[target].shape != w.shape:
                raise ValueError(f"{name}: shape {tuple(w.shape)} != {tuple(params[target].shape)}")
            else:
                params[target].data.copy_(w)
            loaded.add(target if shard is None else f"{target}#{shard}")
        missing = []
        for n in params:
            fused = next((f for f, _, _ in self.stacked_params_mapping if f".{f}." in n), None)
            want = [n] if fused is None else [f"{n}#{i}" for i in self._shard_ids(fused)]
            missing += [w for w in want if w not in loaded]
        if missing:
            raise ValueError(f"weights missing for: {', '.join(missing[:5])}")


EntryClass = LlamaForCausalLM
