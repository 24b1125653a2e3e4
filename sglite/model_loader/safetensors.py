"""A Hugging Face model folder: config.json, *.safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sglite.configs.model_config import ModelConfig
from sglite.model_loader.errors import ModelLoadError
from sglite.model_loader.tokenizer import Tokenizer


def load_hf_config(path: Path) -> ModelConfig:
    """The folder's config.json as a ModelConfig; ModelLoadError naming what is wrong."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: missing config.json")
    try:
        return ModelConfig.from_hf_config(path / "config.json")
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}/config.json: {e}") from None


def load_hf_folder(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as HFTokenizer

    for needed in ("config.json", "tokenizer.json"):
        if not (path / needed).is_file():
            raise ModelLoadError(f"{path}: missing {needed}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    config = load_hf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from None
    tk_cfg = {}
    try:
        if (path / "tokenizer_config.json").is_file():
            tk_cfg = json.loads((path / "tokenizer_config.json").read_text())
        hf_tk = HFTokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
        raise ModelLoadError(f"{path}: unreadable tokenizer files ({' '.join(str(e).split())})") from None
    if not isinstance(tk_cfg, dict):
        raise ModelLoadError(f"{path}/tokenizer_config.json: expected a JSON object")

    def token_id(key: str) -> int | None:
        tok = tk_cfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return hf_tk.token_to_id(tok) if isinstance(tok, str) else None

    eos = config.eos_token_ids or [i for i in [token_id("eos_token")] if i is not None]
    bos = config.bos_token_id if config.bos_token_id is not None else token_id("bos_token")
    template = tk_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    tokenizer = Tokenizer(hf_tk, eos, bos, bool(tk_cfg.get("add_bos_token", False)), template)
    return config, weights, tokenizer
