"""Constrained decoding with xgrammar (SGLang: constrained/xgrammar_backend.py).

xgrammar compiles a grammar against the tokenizer's vocabulary once; a
``GrammarMatcher`` then walks it token by token and fills a bitmask of the tokens
allowed next (32 tokens per int32, -1 = all allowed), applied to the logits in
float32 as -inf (a fill per row: the same bits alone or batched). ``xgrammar`` is
imported on first use: a server that never sees a grammar request never pays for it.
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from sglite.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, GrammarKey

if TYPE_CHECKING:
    from sglite.model_loader.tokenizer import Tokenizer

# xgrammar's C++ errors start "[12:00:00] /project/cpp/regex_converter.cc:94: ", some
# with "Check failed: (error.empty()) is false: " after it
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def error_text(e: BaseException) -> str:
    """xgrammar's message without its C++ source location, on one line."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(e).splitlines()]
    text = " ".join(line for line in lines if line)
    return text[:400] or type(e).__name__


def build_grammar(key: GrammarKey) -> Any:
    """The xgrammar ``Grammar`` of a key, without a vocabulary (the gate's syntax
    check: a bad schema, regex or EBNF is a 400 before anything is queued).
    Raises ValueError naming the parameter."""
    import xgrammar as xgr

    dispatch, text = key
    try:
        if dispatch == "json":
            json.loads(text)
            return xgr.Grammar.from_json_schema(text)
        if dispatch == "regex":
            return xgr.Grammar.from_regex(text)
        if dispatch == "ebnf":
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.from_structural_tag(*_structural_tag_args(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid {_param(dispatch)}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"invalid {_param(dispatch)}: {error_text(e)}") from None


def _param(dispatch: str) -> str:
    return {"json": "json_schema"}.get(dispatch, dispatch)


def _structural_tag_args(text: str) -> tuple[Any, ...]:
    """SGLang's structural_tag: ``{"structures": [{"begin", "schema", "end"}], "triggers"}``
    (xgrammar's legacy form), or xgrammar's own ``{"type": "structural_tag", "format": ...}``."""
    import xgrammar as xgr

    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return items, list(tag["triggers"])
    return (text,)


def tokenizer_info(tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of sglite's tokenizer: each id's token as the ``tokenizers``
    vocabulary spells it (byte-level BPE: GPT-2's byte alphabet). A special token
    (``<|im_start|>``) is given as "" so that no grammar ever allows it; ids past the
    tokenizer's vocabulary (the model's padding rows) likewise."""
    import xgrammar as xgr

    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in tokenizer.special_ids:
            encoded[i] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_json())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                             add_prefix_space=meta["add_prefix_space"])


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, matcher: Any, vocab_size: int, ctx: Any):
        super().__init__()
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.ctx = ctx  # the compiled grammar, shared by every copy

    def accept_token(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ValueError(f"the grammar does not allow token {token} here")
        self.num_accepted += 1

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(batch_size, vocab_size)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))

    def copy(self) -> "XGrammarGrammar":
        import xgrammar as xgr

        return XGrammarGrammar(xgr.GrammarMatcher(self.ctx), self.vocab_size, self.ctx)


class XGrammarGrammarBackend(BaseGrammarBackend):
    """Compiles against the tokenizer's vocabulary; the compiler (and xgrammar's import)
    is built on the first compile, on a pool thread."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: list[int],
                 any_whitespace: bool = True):
        super().__init__()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.any_whitespace = any_whitespace
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    def compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def dispatch(self, key: GrammarKey) -> XGrammarGrammar:
        import xgrammar as xgr

        compiler, (dispatch, text) = self.compiler(), key
        try:
            if dispatch == "json":
                ctx = compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            elif dispatch == "regex":
                ctx = compiler.compile_regex(text)
            elif dispatch == "ebnf":
                ctx = compiler.compile_grammar(text)
            else:
                ctx = compiler.compile_structural_tag(*_structural_tag_args(text))
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise ValueError(error_text(e)) from None
        return XGrammarGrammar(xgr.GrammarMatcher(ctx), self.vocab_size, ctx)
