"""Model loading: GGUF, Hugging Face folders, and the registry of names."""

from __future__ import annotations

from sglite.model_loader.errors import ModelLoadError
from sglite.model_loader.registry import KNOWN_MODELS, LoadedModel, default_cache_dir, load_model, load_model_config

__all__ = ["KNOWN_MODELS", "LoadedModel", "ModelLoadError", "default_cache_dir", "load_model", "load_model_config"]
