"""TokenizerManager: the gate where a request enters (SGLang: managers/tokenizer_manager.py,
its ``_tokenize_one_request`` and ``_validate_one_request``, with SamplingParams'
``normalize``/``verify``).

Every field is type- and range-checked here, before anything is queued or allocated. A
bad request becomes a ``TokenizedGenerateReqInput`` with ``error`` set: the scheduler
answers it at once with a one-line message and an ``abort`` finish reason, and the
rest of its batch runs on. In SGLang this runs in the HTTP server's process; the
offline Engine calls it in-process.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

import jinja2

from sglite.constrained.base_grammar_backend import grammar_key
from sglite.constrained.grammar_manager import BACKEND_NONE_ERROR
from sglite.managers.io_struct import AbortReq, BatchStrOut, LogprobParams, TokenizedGenerateReqInput
from sglite.sampling.sampling_params import UNLIMITED_NEW_TOKENS, SamplingParams, check_utf8, short_repr

if TYPE_CHECKING:
    from sglite.metrics.collector import TokenizerMetricsCollector
    from sglite.model_loader.tokenizer import Tokenizer
    from sglite.server_args import PortArgs


class RequestError(ValueError):
    """A request that cannot run; the message names the field."""


@dataclass
class TokenizerManager:
    tokenizer: "Tokenizer | None"
    vocab_size: int
    max_req_input_len: int  # longest prompt that leaves room for output
    context_len: int
    max_total_num_tokens: int
    grammar_backend: str = "xgrammar"  # --grammar-backend: none refuses grammar requests

    def tokenize(self, rid: str, prompt: Any = None, input_ids: Any = None, messages: Any = None,
                 sampling_params: Any = None, stream: bool = False, extra_key: str | None = None,
                 logprob: LogprobParams | None = None, continue_final_message: bool = False
                 ) -> TokenizedGenerateReqInput:
        """The request ready for the scheduler, or carrying the reason it cannot run.
        ``extra_key``: SGLang's cache key (OpenAI's cache_salt); see io_struct.
        ``logprob``: its logprob fields (kept only when return_logprob is true)."""
        try:
            params = SamplingParams.from_dict(sampling_params)
            params.verify(self.vocab_size)
            if params.stop and self.tokenizer is None:  # SGLang's words
                raise RequestError(f"stop={params.stop!r} is unavailable when skip_tokenizer_init=True (requires "
                                   "tokenizer to decode tokens to text for matching); use stop_token_ids")
            check_extra_key(extra_key)
            self._check_grammar(params)
            if logprob is not None:
                logprob.check(self.vocab_size)
            text, ids = self._prompt(prompt, input_ids, messages, continue_final_message)
            self._validate_one_request(ids)
            if isinstance(sampling_params, dict) and "max_new_tokens" in sampling_params:
                self._check_total(len(ids), params.max_new_tokens)
            if logprob is not None and logprob.return_logprob:
                logprob.start_for(len(ids))
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            return TokenizedGenerateReqInput(rid, None, [], SamplingParams(), stream, error=_one_line(e))
        return TokenizedGenerateReqInput(rid, text, ids, params, stream, extra_key=extra_key,
                                         logprob=logprob if logprob is not None and logprob.return_logprob else None)

    def _check_grammar(self, params: SamplingParams) -> None:
        """A json_schema, regex, ebnf or structural_tag parses (without the vocabulary:
        the scheduler compiles it against that in the background), and this server
        compiles grammars at all."""
        key = grammar_key(params)
        if key is None:
            return
        if self.grammar_backend == "none":
            raise RequestError(BACKEND_NONE_ERROR)
        if self.tokenizer is None:
            raise RequestError("json_schema, regex, ebnf and structural_tag need the tokenizer's vocabulary: they "
                               "are unavailable with --skip-tokenizer-init")
        check_grammar_key(key)

    def _prompt(self, prompt: Any, input_ids: Any, messages: Any,
                continue_final: bool = False) -> tuple[str | None, list[int]]:
        """(text, token ids) from exactly one of: a prompt, chat messages, token ids."""
        given = [name for name, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages))
                 if v is not None]
        if not given:
            raise RequestError("give a prompt, chat messages or input_ids")
        if len(given) > 1:
            raise RequestError(f"give only one of a prompt, chat messages or input_ids (got {', '.join(given)})")
        if input_ids is not None:
            return None, self._check_ids(input_ids)
        if messages is not None:
            messages = _check_messages(messages)
            try:
                prompt = self._chat_prompt(messages, continue_final)
            except RequestError:
                raise
            except Exception as e:  # noqa: BLE001 - a template is code from the model's files: any error
                raise RequestError(f"the chat template failed: {type(e).__name__}: {e}") from None
        if not isinstance(prompt, str):
            raise RequestError(f"the prompt must be a string, got {type(prompt).__name__}")
        self._check_text_bound(prompt)  # (first: it costs nothing, the UTF-8 check a pass over the text)
        check_utf8("the prompt", prompt)
        return prompt, self._need_tokenizer().encode(prompt) if prompt else []

    def _chat_prompt(self, messages: list[dict[str, str]], continue_final: bool) -> str:
        """The chat template's prompt; with ``continue_final`` (SGLang's
        continue_final_message) and an assistant message last, the others' prompt with
        the generation prompt, then that message's text as it is: the model continues it."""
        tokenizer = self._need_tokenizer()
        if continue_final and messages[-1]["role"] == "assistant":
            return tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True) + messages[-1]["content"]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _check_text_bound(self, text: str) -> None:
        """Refuse, before the tokenizer runs, a text too long to fit whatever it encodes
        to: no token covers more than ``max_token_bytes`` bytes (so at least that many
        characters), so a text of more characters than ``max_req_input_len`` tokens can
        cover is over the limit. Keeps a megabytes-long prompt from costing seconds of
        tokenizing before it is refused."""
        per_token = self.tokenizer.max_token_bytes if self.tokenizer is not None else None
        if per_token is not None and len(text) > self.max_req_input_len * per_token:
            raise RequestError(
                f"the prompt has {len(text)} characters, more than the {self.max_req_input_len} tokens that fit "
                f"can hold (at most {per_token} characters a token; context length {self.context_len}, "
                f"KV pool {self.max_total_num_tokens} tokens)")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"input_ids must be a list of integers, got {type(ids).__name__}")
        self._validate_one_request(ids)  # the length first: a huge list is refused before its items are read
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise RequestError(f"input_ids must be integers, got {short_repr(t)}")
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})")
        return list(ids)

    def _validate_one_request(self, ids: list[int] | tuple[int, ...]) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.context_len:  # SGLang's words first
            raise RequestError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({self.context_len} "
                f"tokens): at most {self.max_req_input_len} fit (KV pool {self.max_total_num_tokens} tokens)")
        if len(ids) > self.max_req_input_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; at most {self.max_req_input_len} fit "
                f"(context length {self.context_len}, KV pool {self.max_total_num_tokens} tokens)")

    def _check_total(self, input_len: int, max_new_tokens: int) -> None:
        """A max_new_tokens the request set that cannot fit beside its prompt is refused
        (SGLang's check and words); one left unset runs to what the context leaves."""
        total = input_len + max_new_tokens
        if max_new_tokens < UNLIMITED_NEW_TOKENS and total > self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {total} tokens: {input_len} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.")

    def _need_tokenizer(self) -> "Tokenizer":
        if self.tokenizer is None:  # SGLang's words
            raise RequestError("The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
                               "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False.")
        return self.tokenizer


MAX_EXTRA_KEY_LEN = 256  # characters of a cache_salt / extra_key


@functools.lru_cache(maxsize=256)
def check_grammar_key(key: tuple[str, str]) -> None:
    """ValueError naming the parameter when the grammar does not parse (a key that
    parsed is remembered: the same schema on every request is checked once)."""
    from sglite.constrained.xgrammar_backend import build_grammar

    build_grammar(key)


def check_extra_key(key: Any) -> None:
    """None, or a non-empty string of at most MAX_EXTRA_KEY_LEN characters."""
    if key is None:
        return
    if not isinstance(key, str) or not key:
        raise RequestError(f"cache_salt / extra_key must be a non-empty string, got {short_repr(key)}")
    if len(key) > MAX_EXTRA_KEY_LEN:
        raise RequestError(f"cache_salt / extra_key has {len(key)} characters; at most {MAX_EXTRA_KEY_LEN}")
    check_utf8("cache_salt / extra_key", key)


MAX_RID_LEN = 512  # characters of a request id


def check_rid(rid: Any) -> str:
    """A request id: a non-empty UTF-8 string of at most MAX_RID_LEN characters (it is
    echoed in every answer and kept in the scheduler's history)."""
    if not isinstance(rid, str) or not rid:
        raise RequestError(f"rid must be a non-empty string, got {short_repr(rid)}")
    if len(rid) > MAX_RID_LEN:
        raise RequestError(f"rid has {len(rid)} characters; at most {MAX_RID_LEN}")
    try:
        check_utf8("rid", rid)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return rid


def _check_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages: a list of {"role": str, "content": str}, UTF-8 text."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RequestError(f"each message must be a dict with string 'role' and 'content', got {short_repr(m)}")
        check_utf8("a message's role", m["role"])
        check_utf8("a message's content", m["content"])
    return messages


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


# SGLang's logprob fields of a /generate body (and Engine.generate's keywords)
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                  "return_text_in_logprobs")


def logprob_params_each(n: int, return_logprob: Any = False, logprob_start_len: Any = None,
                        top_logprobs_num: Any = None, token_ids_logprob: Any = None,
                        return_text_in_logprobs: Any = False) -> list[LogprobParams]:
    """Each of ``n`` requests' logprob fields, SGLang's batch rule: a value is for every
    request, a list one per request (token_ids_logprob: a list of ints is for every
    request, a list of lists one per request); None is the default. RequestError for a
    list of the wrong length."""

    def each(name: str, value: Any, per_request_list: bool) -> list[Any]:
        if per_request_list:
            if len(value) != n:
                raise RequestError(f"{name} must be one value, or a list of {n}, for a batch of {n}")
            return list(value)
        return [value] * n

    flags = each("return_logprob", return_logprob, isinstance(return_logprob, list))
    starts = each("logprob_start_len", logprob_start_len, isinstance(logprob_start_len, list))
    tops = each("top_logprobs_num", top_logprobs_num, isinstance(top_logprobs_num, list))
    nested = isinstance(token_ids_logprob, list) and bool(token_ids_logprob) and isinstance(token_ids_logprob[0], list)
    ids = each("token_ids_logprob", token_ids_logprob, nested)
    # every request's fields are checked by the gate, also with return_logprob false
    return [LogprobParams(False if f is None else f, -1 if s is None else s, 0 if k is None else k, t or None,
                          return_text_in_logprobs) for f, s, k, t in zip(flags, starts, tops, ids)]


LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "input_token_ids_logprobs", "output_token_ids_logprobs")


@dataclass
class LogprobOutput:
    """One request's logprobs as the scheduler sends them, collected, and made into
    SGLang's meta_info keys (its TokenizerManager's ``convert_logprob_style``): entries
    ``(logprob, token id, text)``, the text only with return_text_in_logprobs (each
    token decoded alone); the top and asked-about keys only when asked for."""

    params: LogprobParams
    tokenizer: "Tokenizer | None" = None  # for the texts
    collected: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in LOGPROB_KEYS})
    _texts: dict[int, str] = field(default_factory=dict, repr=False)  # token id -> text (_texter)

    def add(self, delta: dict[str, list[Any]] | None) -> None:
        for key, entries in (delta or {}).items():
            self.collected[key] += entries

    def meta_info(self, delta: dict[str, list[Any]] | None = None) -> dict[str, Any]:
        """SGLang's keys for everything collected (or only ``delta``, a stream's new part)."""
        got = self.collected if delta is None else {k: delta.get(k, []) for k in LOGPROB_KEYS}
        keys = LOGPROB_KEYS[:2] + (LOGPROB_KEYS[2:4] if self.params.top_logprobs_num else ()) + (
            LOGPROB_KEYS[4:] if self.params.token_ids_logprob else ())
        text = self._texter()
        out: dict[str, Any] = {}
        for key in keys:
            if key.endswith("token_logprobs"):
                out[key] = [(v, t, text(t)) for v, t in got[key]]
            else:  # per position a list of entries, or None (the first prompt position)
                out[key] = [None if pos is None else [(v, t, text(t)) for v, t in pos] for pos in got[key]]
        return out

    def _texter(self) -> Any:
        """token id -> its text, each id decoded once: a stream rebuilds its cumulative
        meta_info every event, on the server's event loop."""
        tokenizer = self.tokenizer
        if not self.params.return_text_in_logprobs or tokenizer is None:
            return lambda token_id: None
        texts = self._texts

        def text(token_id: int) -> str:
            if token_id not in texts:
                texts[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
            return texts[token_id]

        return text


@dataclass
class ServerReqState:
    """One request in flight in the server (SGLang's ReqState): what came back so far,
    and an event set whenever more does."""

    rid: str
    event: Any  # asyncio.Event
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    outs: list[BatchStrOut] = field(default_factory=list)  # unread by the request's handler
    finished: bool = False
    meta_info: dict[str, Any] = field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None
    logprob: LogprobOutput | None = None  # return_logprob: what came of it

    def result_meta(self) -> dict[str, Any]:
        """meta_info as a route answers it: the request's, its logprobs so far."""
        return dict(self.meta_info, **(self.logprob.meta_info() if self.logprob is not None else {}))


@dataclass
class ReqSpec:
    """One request as a route parsed it, before the gate checks and tokenizes it."""

    rid: str
    prompt: Any = None
    input_ids: Any = None
    messages: Any = None
    sampling_params: Any = None
    stream: bool = False
    extra_key: Any = None
    logprob: LogprobParams | None = None
    continue_final_message: bool = False  # (chat) continue the last, assistant, message

    def work_size(self) -> int:
        """Characters the tokenizer reads, or token ids the gate checks: what decides
        where that work runs."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        if isinstance(self.input_ids, list):
            return len(self.input_ids)
        if isinstance(self.messages, list):
            return sum(len(m.get("content") or "") for m in self.messages
                       if isinstance(m, dict) and isinstance(m.get("content"), str))
        return 0


# Requests of up to this many characters (or token ids) in all are checked and tokenized
# on the event loop (a few ms at most); bigger ones on a worker thread, where the
# tokenizer lets go of the GIL and Python code yields it every few ms: one client's long
# prompt costs its own wait, not everyone's.
INLINE_WORK = 8192


class Claim:
    """The requests of one HTTP request, sent to the scheduler; ``release`` (idempotent)
    aborts those unfinished and forgets them all. It runs when the handler is done, when
    a stream ends or is closed, and when a stream is dropped without ever being read
    (``__del__``), so no rid stays taken by a client that went away."""

    def __init__(self, manager: "ServerTokenizerManager", states: list[ServerReqState]):
        self.manager, self.states, self.released = manager, states, False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for state in self.states:
            if self.manager.rid_to_state.get(state.rid) is state:
                del self.manager.rid_to_state[state.rid]
            if not state.finished:  # the handler stopped reading (a client that went away)
                self.manager.abort_request(state.rid)
                if self.manager.metrics is not None:
                    self.manager.metrics.num_aborted_requests_total.inc()

    def __del__(self) -> None:
        if not self.released:
            self.release()


class ServerTokenizerManager:
    """SGLang's TokenizerManager as the HTTP server's process runs it (asyncio): the gate
    above checks and tokenizes each request, which then goes to the Scheduler process
    over ZMQ; ``handle_loop`` receives the DetokenizerManager's text (and the scheduler's
    answers to control requests) and wakes the request's handler."""

    def __init__(self, gate: TokenizerManager, port_args: "PortArgs", metrics: "TokenizerMetricsCollector | None"):
        import zmq
        import zmq.asyncio
        from concurrent.futures import ThreadPoolExecutor

        self.gate, self.metrics = gate, metrics
        ctx = zmq.asyncio.Context()
        self.recv_from_detokenizer = ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        self.send_to_scheduler = ctx.socket(zmq.PUSH)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.rid_to_state: dict[str, ServerReqState] = {}
        self.control_waiters: deque[Any] = deque()  # futures of control requests, answered in order
        self.control_lock: Any = None  # an asyncio.Lock, made in the server's loop
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglite-tokenize")
        self.last_output_tstamp = 0.0  # time.monotonic() when some request's tokens last came (health checks)

    async def submit(self, specs: list[ReqSpec], trace_parent: str = "", batch: bool = False) -> Claim:
        """Check, tokenize and send every request of one HTTP request, all or none: the
        rids are claimed first, at once (a rid in use, or twice here, is a RequestError:
        two clients racing for one rid cannot both get it), then each request is checked
        (RequestError naming the first bad one; ``batch``: "request i of the batch: ..."),
        then all are sent. ``trace_parent``: the W3C traceparent their spans continue."""
        rids = [check_rid(s.rid) for s in specs]
        states = self._claim(rids)
        for state, spec in zip(states, specs):
            if spec.logprob is not None and spec.logprob.return_logprob:
                state.logprob = LogprobOutput(spec.logprob, self.gate.tokenizer)
        try:
            reqs = await self._tokenize(specs)
            for i, req in enumerate(reqs):
                if req.error:
                    raise RequestError(f"request {i} of the batch: {req.error}" if batch else req.error)
        except BaseException:
            self._forget(rids)  # nothing was sent: nothing to abort
            raise
        for req in reqs:
            req.trace_parent = trace_parent
            self.send_to_scheduler.send_pyobj(req)
        return Claim(self, states)

    def _claim(self, rids: list[str]) -> list[ServerReqState]:
        """Take every rid or none (synchronous: no other handler runs in between)."""
        if len(set(rids)) != len(rids):
            raise RequestError("the rids of a batch must differ")
        busy = next((r for r in rids if r in self.rid_to_state), None)
        if busy is not None:
            raise RequestError(f"Duplicate request ID detected: {busy!r} is already in use by an unfinished request")
        now = time.monotonic()
        states = [ServerReqState(r, asyncio.Event(), now) for r in rids]
        self.rid_to_state.update((st.rid, st) for st in states)
        return states

    def _forget(self, rids: list[str]) -> None:
        for r in rids:
            self.rid_to_state.pop(r, None)

    async def _tokenize(self, specs: list[ReqSpec]) -> list[TokenizedGenerateReqInput]:
        def run() -> list[TokenizedGenerateReqInput]:
            return [self.gate.tokenize(s.rid, s.prompt, s.input_ids, s.messages, s.sampling_params, s.stream,
                                       s.extra_key, s.logprob, s.continue_final_message) for s in specs]

        if sum(s.work_size() for s in specs) <= INLINE_WORK:
            return run()
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, run)

    async def results(self, state: ServerReqState) -> AsyncIterator[ServerReqState]:
        """Yield the request's state each time more of it came back, until it finished."""
        while not state.finished:
            await state.event.wait()
            state.event.clear()
            yield state

    def abort_request(self, rid: str, message: str = "aborted by user") -> None:
        self.send_to_scheduler.send_pyobj(AbortReq(rid, message))

    def abort_all(self, message: str = "aborted by user") -> list[str]:
        rids = list(self.rid_to_state)
        for rid in rids:
            self.abort_request(rid, message)
        return rids

    async def drain(self, grace: float, answer_within: float = 1.0) -> None:
        """The server stops: requests in flight may finish for ``grace`` seconds; the rest
        are aborted ('the server is shutting down') and answered with what they have, by
        the scheduler or, if it does not answer within ``answer_within`` s (it died),
        here. Every handler returns a response; none is cancelled mid-wait."""
        deadline = time.monotonic() + grace
        while self.rid_to_state and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        message = "the server is shutting down"
        self.abort_all(message)
        deadline = time.monotonic() + answer_within
        while self.rid_to_state and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for state in list(self.rid_to_state.values()):
            if not state.finished:
                state.finished = True
                state.meta_info = {"finish_reason": {"type": "abort", "message": message},
                                   "completion_tokens": len(state.output_ids),
                                   "e2e_latency": time.monotonic() - state.created}
                state.event.set()

    async def control(self, request: Any) -> Any:
        """Send a control request to the scheduler and await its answer."""
        if self.control_lock is None:
            self.control_lock = asyncio.Lock()
        async with self.control_lock:  # one at a time: answers come back in order
            future = asyncio.get_running_loop().create_future()
            self.control_waiters.append(future)
            await self.send_to_scheduler.send_pyobj(request)
            return await future

    async def handle_loop(self) -> None:
        """Route what the detokenizer (text) and the scheduler (control answers) send."""
        while True:
            msg = await self.recv_from_detokenizer.recv_pyobj()
            if not isinstance(msg, list):
                if self.control_waiters:
                    self.control_waiters.popleft().set_result(msg)
                continue
            now = time.monotonic()
            for out in msg:
                state = self.rid_to_state.get(out.rid)
                if state is not None:
                    self._add(state, out, now)

    def _add(self, state: ServerReqState, out: BatchStrOut, now: float) -> None:
        state.text += out.new_text
        state.output_ids += out.new_token_ids
        state.outs.append(out)
        if state.logprob is not None:
            state.logprob.add(out.logprobs)
        if out.new_token_ids:
            self.last_output_tstamp = now
            if state.first_token_time is None:
                state.first_token_time = now
                if self.metrics is not None:
                    self.metrics.time_to_first_token.observe(now - state.created)
            elif self.metrics is not None:
                self.metrics.inter_token_latency.observe((now - state.last_token_time) / len(out.new_token_ids))
            state.last_token_time = now
        if out.finished:
            state.finished, state.meta_info = True, dict(out.meta_info)
            state.meta_info["e2e_latency"] = now - state.created
            if self.metrics is not None:
                self.metrics.observe_finished(state.meta_info, now - state.created)
        state.event.set()
