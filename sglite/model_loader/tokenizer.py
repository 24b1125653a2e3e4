"""Tokenizer: byte-level BPE through the ``tokenizers`` library, plus the model's chat
template rendered with jinja2 (SGLang uses HF's AutoTokenizer; sglite needs no
transformers at run time)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizer split patterns for BPE vocabularies that do not use GPT-2's; keyed by
# llama.cpp's ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def build_byte_level_bpe(tokens: list[str], merges: list[str], special: list[str], pre: str | None,
                         user_defined: list[str] = ()) -> HFTokenizer:
    """Mirror transformers' GGUF conversion, token for token: that is the reference the
    real-model tests hold sglite to."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        # a token outside the byte alphabet is stored as text; spell its UTF-8 bytes
        key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab[key] = i  # a duplicate spelling keeps its last id, as transformers does
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    # a control token outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocab
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special if set(t) <= alphabet])
    known = tk.get_vocab()
    tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined if t in known])
    return tk


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: list[int], bos_token_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        self._tk = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        # ids that decode to nothing with skip_special_tokens (every other id decodes
        # to at least one byte)
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for (its decoded UTF-8), so that a text
        of n characters needs at least n / max_token_bytes tokens. None when a normalizer
        rewrites the text before the model sees it (then no such bound is known)."""
        if self._tk.normalizer is not None:
            return None
        decode = self._tk.decode
        return max(len(decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass"))
                   for i in range(self.vocab_size))

    def get_vocab(self) -> dict[str, int]:
        """Every token as the ``tokenizers`` vocabulary spells it -> its id (added tokens too)."""
        return self._tk.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The ``tokenizers`` serialization (what tokenizer.json holds)."""
        return self._tk.to_str()

    def id_to_token(self, i: int) -> str | None:
        return self._tk.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids, with the model's BOS first when it wants one (and
        ``add_special_tokens``: /tokenize's switch)."""
        # encode_batch lets go of the GIL while it works (encode holds it throughout):
        # a long prompt tokenized on another thread does not stall this process's others
        ids = self._tk.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template: {message}")

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        tok = self._tk.id_to_token
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tok(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=tok(self.eos_token_ids[0]) if self.eos_token_ids else "",
        )

    # --- persistence (the conversion cache) -------------------------------------------

    def save(self, directory: Path) -> None:
        self._tk.save(str(directory / "tokenizer.json"))
        (directory / "sglite_tokenizer.json").write_text(json.dumps({
            "eos_token_ids": self.eos_token_ids, "bos_token_id": self.bos_token_id,
            "add_bos": self.add_bos, "chat_template": self.chat_template}, indent=2))

    @classmethod
    def load(cls, directory: Path) -> "Tokenizer":
        cfg = json.loads((directory / "sglite_tokenizer.json").read_text())
        return cls(HFTokenizer.from_file(str(directory / "tokenizer.json")), cfg["eos_token_ids"],
                   cfg.get("bos_token_id"), cfg.get("add_bos", False), cfg.get("chat_template"))
