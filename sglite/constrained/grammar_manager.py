"""The scheduler's grammar_queue (SGLang: constrained/grammar_manager.py).

A request whose grammar is not compiled yet waits here, not in the waiting_queue: its
compile runs on the backend's thread pool while the scheduler goes on with other
requests. Each iteration ``get_ready_grammar_requests`` hands back the requests whose
compile is done (their own grammar object, or finished with the compile error) and
those that waited ``SGLANG_GRAMMAR_MAX_POLL_ITERATIONS`` polls (finished with SGLang's
timeout error); the scheduler moves them on (move_ready_grammar_requests).
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from sglite.constrained.base_grammar_backend import (BaseGrammarBackend, InvalidGrammarObject, grammar_key)
from sglite.server_args import env_knob

if TYPE_CHECKING:
    from sglite.managers.schedule_batch import Req
    from sglite.model_loader.tokenizer import Tokenizer
    from sglite.server_args import ServerArgs

logger = logging.getLogger("sglite")

# SGLang's defaults: each poll waits up to this long when nothing else can run
DEFAULT_POLL_INTERVAL = 0.005  # seconds (SGLANG_GRAMMAR_POLL_INTERVAL)
DEFAULT_MAX_POLL_ITERATIONS = 10000  # (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS)
BACKEND_NONE_ERROR = ("Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when "
                      "the server is launched with --grammar-backend none")


def create_grammar_backend(server_args: "ServerArgs", tokenizer: "Tokenizer | None", vocab_size: int,
                           eos_token_ids: set[int]) -> BaseGrammarBackend | None:
    """The backend --grammar-backend names; None for ``none`` or without a tokenizer
    (--skip-tokenizer-init: the gate refuses grammar requests then)."""
    if server_args.grammar_backend == "none" or tokenizer is None:
        return None
    from sglite.constrained.xgrammar_backend import XGrammarGrammarBackend

    return XGrammarGrammarBackend(tokenizer, vocab_size, sorted(eos_token_ids),
                                  any_whitespace=not server_args.constrained_json_disable_any_whitespace)


class GrammarManager:
    def __init__(self, backend: BaseGrammarBackend | None):
        self.grammar_backend = backend
        self.grammar_queue: list["Req"] = []
        self.poll_interval = env_knob("SGLANG_GRAMMAR_POLL_INTERVAL", DEFAULT_POLL_INTERVAL, float)
        self.max_poll_iterations = env_knob("SGLANG_GRAMMAR_MAX_POLL_ITERATIONS", DEFAULT_MAX_POLL_ITERATIONS, int)

    def __len__(self) -> int:
        return len(self.grammar_queue)

    def has_waiting_grammars(self) -> bool:
        return bool(self.grammar_queue)

    def process_req_with_grammar(self, req: "Req") -> str | None:
        """Give a new request its grammar: its own on a cache hit, else a compile's future
        and a place in grammar_queue (SGLang's add_to_grammar_queue). Returns why it
        cannot run (no backend, a cached compile error), None if it can."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return None
        if self.grammar_backend is None:
            return BACKEND_NONE_ERROR
        value, cache_hit = self.grammar_backend.get_cached_or_future_value(key)
        req.grammar, req.grammar_key = value, key
        if not cache_hit:
            self.grammar_queue.append(req)
        return _compile_error(req)

    def is_queued(self, req: "Req") -> bool:
        return any(r is req for r in self.grammar_queue)

    def get_ready_grammar_requests(self, block: bool) -> tuple[list["Req"], list[tuple["Req", str]]]:
        """The queued requests whose grammar is ready (each with its own copy), and
        those that cannot run with why (compile error or timeout); both leave the
        queue. ``block``: nothing else can run, so wait up to the poll interval."""
        pending = [r.grammar for r in self.grammar_queue if isinstance(r.grammar, Future)]
        if block and pending:
            concurrent.futures.wait(pending, timeout=self.poll_interval, return_when=concurrent.futures.FIRST_COMPLETED)
        ready: list["Req"] = []
        failed: list[tuple["Req", str]] = []
        waiting: list["Req"] = []
        for req in self.grammar_queue:
            future = req.grammar
            assert isinstance(future, Future)
            if future.done():
                req.grammar = future.result().copy()
                error = _compile_error(req)
                if error:
                    failed.append((req, error))
                else:
                    ready.append(req)
                continue
            req.grammar_wait_ct += 1
            if req.grammar_wait_ct >= self.max_poll_iterations:
                req.grammar = None
                failed.append((req, f"Grammar preprocessing timed out: grammar_key={req.grammar_key!r}"))
            else:
                waiting.append(req)
        self.grammar_queue = waiting
        return ready, failed

    def remove(self, req: "Req") -> bool:
        """Take an aborted request out of the queue; its compile goes on for the
        cache (other requests may share it). True if it was queued."""
        if req not in self.grammar_queue:
            return False
        self.grammar_queue.remove(req)
        req.grammar = None
        return True

    def reset(self) -> None:
        if self.grammar_backend is not None:
            self.grammar_backend.reset()

    def shutdown(self) -> None:
        if self.grammar_backend is not None:
            self.grammar_backend.shutdown()


def _compile_error(req: "Req") -> str | None:
    """SGLang's message for a grammar that did not compile; None if it did."""
    if isinstance(req.grammar, InvalidGrammarObject):
        assert req.grammar_key is not None
        return f"Failed to compile {req.grammar_key[0]} grammar: {req.grammar.error_message}"
    return None
