"""The grammar interface the scheduler and the sampler use, and the backend that
compiles grammars in the background and caches them by key (SGLang:
constrained/base_grammar_backend.py).

A grammar key is SGLang's ``(dispatch type, text)``: ``("json", schema)``,
``("regex", pattern)``, ``("ebnf", grammar)`` or ``("structural_tag", json)``. Compiling
one against the vocabulary takes milliseconds to seconds, so it runs on a thread pool:
the request waits in the scheduler's grammar_queue meanwhile (grammar_manager.py).
The cache holds one compiled *template* per key; every request gets its own
``copy()`` (a fresh matcher over the shared compiled grammar).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglite.sampling.sampling_params import SamplingParams

GrammarKey = tuple[str, str]
# the sampling parameters that ask for a grammar, and their dispatch types (SGLang's)
DISPATCH_TYPES = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2


def grammar_key(params: "SamplingParams") -> GrammarKey | None:
    """The request's grammar key; None when it asks for no grammar (the gate saw to it
    that at most one of the four is set)."""
    for name, dispatch in DISPATCH_TYPES.items():
        value = getattr(params, name)
        if value is not None:
            return dispatch, value
    return None


class BaseGrammarObject:
    """One request's grammar state: what has been accepted, what may come next.
    Invariant (the scheduler keeps it): ``num_accepted`` equals the number of the
    request's output tokens the grammar has seen, i.e. ``len(req.output_ids)``."""

    def __init__(self) -> None:
        self.finished = False  # the request finished: its rows are no longer masked
        self.num_accepted = 0

    def accept_token(self, token: int) -> None:
        """Advance by one sampled token; ValueError if the grammar refuses it."""
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens."""
        raise NotImplementedError

    def rollback_to(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` accepted tokens (retraction)."""
        if self.num_accepted > num_tokens:
            self.rollback(self.num_accepted - num_tokens)

    def is_terminated(self) -> bool:
        """The grammar accepted its stop token: nothing more may follow."""
        raise NotImplementedError

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        """A mask for the whole batch, every token allowed in every row."""
        raise NotImplementedError

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Row ``idx`` of the mask: the tokens this grammar allows next."""
        raise NotImplementedError

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        """In place: the logits of refused tokens become -inf (row by row)."""
        raise NotImplementedError

    def copy(self) -> "BaseGrammarObject":
        """A fresh state over the same compiled grammar."""
        raise NotImplementedError


class InvalidGrammarObject(BaseGrammarObject):
    """A grammar that did not compile: the request that asked for it finishes with
    ``error_message``; cached, so the same key fails at once next time."""

    def __init__(self, error_message: str):
        super().__init__()
        self.error_message = error_message

    def copy(self) -> "InvalidGrammarObject":
        return InvalidGrammarObject(self.error_message)


class BaseGrammarBackend:
    """Compiles grammars on a thread pool; caches the results by key (LRU)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="sglite-grammar")
        self.cache: OrderedDict[GrammarKey, BaseGrammarObject] = OrderedDict()
        self.in_flight: dict[GrammarKey, Future] = {}
        self.lock = threading.Lock()

    def get_cached_or_future_value(self, key: GrammarKey) -> tuple[BaseGrammarObject | Future, bool]:
        """(the request's own grammar, True) on a cache hit; else (a future of the
        compiled template, False). Requests asking for a key being compiled share its
        future: one compile per key."""
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key].copy(), True
            future = self.in_flight.get(key)
            if future is None:
                future = self.executor.submit(self._compile_and_cache, key)
                self.in_flight[key] = future
            return future, False

    def _compile_and_cache(self, key: GrammarKey) -> BaseGrammarObject:
        try:
            value = self.dispatch(key)
        except Exception as e:  # noqa: BLE001 - any compile error belongs to the requests that asked
            value = InvalidGrammarObject(f"{type(e).__name__}: {e}".strip().splitlines()[-1])
        self.set_cache(key, value)
        return value

    def set_cache(self, key: GrammarKey, value: BaseGrammarObject) -> None:
        with self.lock:
            self.in_flight.pop(key, None)
            self.cache[key] = value
            self.cache.move_to_end(key)
            while len(self.cache) > MAX_CACHED_GRAMMARS:
                self.cache.popitem(last=False)

    def dispatch(self, key: GrammarKey) -> BaseGrammarObject:
        """Compile ``key`` (on a pool thread); raise for a grammar that cannot be built."""
        raise NotImplementedError

    def reset(self) -> None:
        """Drop every cached grammar (flush_cache)."""
        with self.lock:
            self.cache.clear()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
