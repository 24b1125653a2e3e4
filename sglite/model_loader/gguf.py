"""GGUF loading: metadata -> ModelConfig, tensors dequantized to float32 with
Hugging Face names, tokenizer from the file's vocabulary and merges."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from sglite.configs.model_config import ModelConfig
from sglite.model_loader.errors import ModelLoadError
from sglite.model_loader.tokenizer import Tokenizer, build_byte_level_bpe

SUPPORTED_ARCHS = ("llama", "qwen2")
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # gguf cannot dequantize Q8_K

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _reader(path: Path):  # noqa: ANN202
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError, struct errors, numpy errors...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):  # noqa: ANN001, ANN202
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    base = _GLOBAL_NAMES.get(stem)
    return None if base is None else f"{base}.{kind}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which reorders each head's rows from rotate-half
    (HF) to interleaved pairs: rows (h, 2, d/2) were stored as (h, d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        old_ctx: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as ``rope_freqs``."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, blended))


def llama3_scaling_from_rope_freqs(freqs: np.ndarray, theta: float, head_dim: int, old_ctx: int | None,
                                   path: Path) -> dict[str, float | int | str] | None:
    """Recover HF's llama3 ``rope_scaling`` from the ``rope_freqs`` tensor.

    llama.cpp writes Llama 3.1-style scaling only as that tensor, not as metadata, and
    our RoPE (like HF's) takes the four parameters, so search the few values real
    checkpoints use for the ones that reproduce the tensor."""
    factor = float(freqs.max())
    if np.allclose(freqs, 1.0):
        return None
    contexts = [int(old_ctx)] if old_ctx else [8192, 4096, 2048, 16384, 32768, 65536, 131072]
    for ctx in contexts:
        for low in (1.0, 0.5, 2.0, 4.0):
            for high in (4.0, 2.0, 8.0, 1.0, 16.0, 32.0):
                if high <= low or len(freqs) != head_dim // 2:
                    continue
                if np.allclose(llama3_rope_factors(theta, head_dim, factor, low, high, ctx), freqs, rtol=1e-5):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": ctx}
    raise ModelLoadError(f"{path}: rope_freqs.weight does not match llama3 RoPE scaling; sglite cannot run it")


def read_config(reader, path: Path) -> ModelConfig:  # noqa: ANN001
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (sglite runs {', '.join(SUPPORTED_ARCHS)})")

    def meta(key: str, default=None):  # noqa: ANN001, ANN202
        return _field(reader, f"{arch}.{key}", default)

    def need(key: str) -> int:
        value = meta(key)
        if value is None:
            raise ModelLoadError(f"{path}: metadata key {arch}.{key} is missing")
        return int(value)

    hidden = need("embedding_length")
    heads = need("attention.head_count")
    kv_heads = int(meta("attention.head_count_kv", heads))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_theta = float(meta("rope.freq_base", 10000.0))
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: RoPE scaling {scaling_type!r} is not supported (sglite runs linear and llama3)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None and rope_scaling is None:
        rope_scaling = llama3_scaling_from_rope_freqs(
            np.asarray(freqs.data, dtype=np.float64).reshape(-1), rope_theta, head_dim,
            meta("rope.scaling.original_context_length"), path)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_hidden_layers=need("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings=not has_output,
        attention_bias=arch == "qwen2",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
        name=str(_field(reader, "general.name", path.stem)),
    )


def read_tokenizer(reader, path: Path) -> Tokenizer:  # noqa: ANN001
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"{path}: tokenizer type {model!r} is not supported (sglite builds byte-level BPE, 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = list(_field(reader, "tokenizer.ggml.merges") or [])
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    special = [t for t, ty in zip(tokens, types) if ty == 3]  # llama.cpp CONTROL tokens
    # transformers also makes the named bos/eos/unk/pad tokens special, whatever their type
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        i = _field(reader, f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens) and tokens[int(i)] not in special:
            special.append(tokens[int(i)])
    user_defined = [t for t, ty in zip(tokens, types) if ty == 4]  # matched whole, but not special
    tk = build_byte_level_bpe(tokens, merges, special, _field(reader, "tokenizer.ggml.pre"), user_defined)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return Tokenizer(tk, [int(eos)] if eos is not None else [], _field(reader, "tokenizer.ggml.bos_token_id"),
                     bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
                     _field(reader, "tokenizer.chat_template"))


def read_tensors(reader, config: ModelConfig, path: Path,
                 progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    import gguf

    weights: dict[str, torch.Tensor] = {}
    n = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = hf_name(t.name)
        if name is None:
            continue  # rope_freqs and other llama.cpp extras
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANTS:
            raise ModelLoadError(f"{path}: tensor {t.name} has quantization {qtype}, which sglite cannot read "
                                 f"(supported: {', '.join(SUPPORTED_QUANTS)})")
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: tensor {t.name} ({qtype}) could not be dequantized: {e}") from None
        w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # a copy: the file is mapped read-only
        if config.architecture == "llama":
            if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
                w = unpermute_qk(w, config.num_attention_heads)
            elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
                w = unpermute_qk(w, config.num_key_value_heads)
        weights[name] = w.contiguous()
        if progress is not None and progress_due(i, n):
            progress(f"converting {path.name} ({n} tensors) ... {100 * (i + 1) // n}%")
    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor; is this a language model GGUF?")
    return weights


def progress_due(i: int, n: int) -> bool:
    """Tell the conversion's progress after tensor ``i`` of ``n``: every tenth of them,
    and at the last whatever ``n`` is (SmolLM2's 272 stopped at 99%)."""
    return (i + 1) % max(1, n // 10) == 0 or i + 1 == n


def check_magic(path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")


def load_gguf_config(path: Path) -> ModelConfig:
    """The config from the GGUF's metadata; the tensors are not read."""
    check_magic(path)
    return read_config(_reader(path), path)


def load_gguf(path: Path, progress: Callable[[str], None] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    check_magic(path)
    reader = _reader(path)
    config = read_config(reader, path)
    tokenizer = read_tokenizer(reader, path)
    weights = read_tensors(reader, config, path, progress)
    return config, weights, tokenizer


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
