"""Architecture hyper-parameters of a Llama-family model (SGLang: configs/model_config.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ModelConfig:
    """What the model code needs to build the network; names follow HF's config.json."""

    architecture: str = "llama"  # "llama" or "qwen2" (QKV bias)
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    @property
    def context_len(self) -> int:
        return self.max_position_embeddings

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "ModelConfig":
        """Read a Hugging Face ``config.json``."""
        hf = json.loads(Path(path).read_text())
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = "qwen2" if "Qwen2" in archs[0] or hf.get("model_type") == "qwen2" else "llama"
        if arch == "llama" and not archs[0].startswith(("Llama", "Mistral")):
            raise ValueError(f"unsupported architecture {archs[0]!r} in {path}")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0),
            rope_scaling=hf.get("rope_scaling"),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or hf.get("attention_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=hf.get("_name_or_path", ""),
        )
