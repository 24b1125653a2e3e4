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

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

import jinja2

from sglite.managers.io_struct import AbortReq, BatchStrOut, TokenizedGenerateReqInput
from sglite.sampling.sampling_params import SamplingParams

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

    def tokenize(self, rid: str, prompt: Any = None, input_ids: Any = None, messages: Any = None,
                 sampling_params: Any = None, stream: bool = False) -> TokenizedGenerateReqInput:
        """The request ready for the scheduler, or carrying the reason it cannot run."""
        try:
            params = SamplingParams.from_dict(sampling_params)
            params.verify(self.vocab_size)
            text, ids = self._prompt(prompt, input_ids, messages)
            self._validate_one_request(ids)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            return TokenizedGenerateReqInput(rid, None, [], SamplingParams(), stream, error=_one_line(e))
        return TokenizedGenerateReqInput(rid, text, ids, params, stream)

    def _prompt(self, prompt: Any, input_ids: Any, messages: Any) -> tuple[str | None, list[int]]:
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
                prompt = self._need_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
            except RequestError:
                raise
            except Exception as e:  # noqa: BLE001 - a template is code from the model's files: any error
                raise RequestError(f"the chat template failed: {type(e).__name__}: {e}") from None
        if not isinstance(prompt, str):
            raise RequestError(f"the prompt must be a string, got {type(prompt).__name__}")
        return prompt, self._need_tokenizer().encode(prompt) if prompt else []

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"input_ids must be a list of integers, got {type(ids).__name__}")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise RequestError(f"input_ids must be integers, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})")
        return list(ids)

    def _validate_one_request(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > self.max_req_input_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; at most {self.max_req_input_len} fit "
                f"(context length {self.context_len}, KV pool {self.max_total_num_tokens} tokens)")

    def _need_tokenizer(self) -> "Tokenizer":
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; pass input_ids")
        return self.tokenizer


def _check_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages: a list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RequestError(f"each message must be a dict with string 'role' and 'content', got {m!r}")
    return messages


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


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


class ServerTokenizerManager:
    """SGLang's TokenizerManager as the HTTP server's process runs it (asyncio): the gate
    above checks and tokenizes each request, which then goes to the Scheduler process
    over ZMQ; ``handle_loop`` receives the DetokenizerManager's text (and the scheduler's
    answers to control requests) and wakes the request's handler."""

    def __init__(self, gate: TokenizerManager, port_args: "PortArgs", metrics: "TokenizerMetricsCollector | None"):
        import zmq
        import zmq.asyncio

        self.gate, self.metrics = gate, metrics
        ctx = zmq.asyncio.Context()
        self.recv_from_detokenizer = ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        self.send_to_scheduler = ctx.socket(zmq.PUSH)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.rid_to_state: dict[str, ServerReqState] = {}
        self.control_waiters: deque[Any] = deque()  # futures of control requests, answered in order
        self.control_lock: Any = None  # an asyncio.Lock, made in the server's loop

    def check(self, rid: str, prompt: Any = None, input_ids: Any = None, messages: Any = None,
              sampling_params: Any = None, stream: bool = False, trace_parent: str = "") -> TokenizedGenerateReqInput:
        """The tokenized request; raises RequestError (a 400) for a bad one or a rid in use.
        ``trace_parent``: the W3C traceparent the request's spans continue."""
        if rid in self.rid_to_state:
            raise RequestError(f"request id {rid!r} is already in use by an unfinished request")
        req = self.gate.tokenize(rid, prompt, input_ids, messages, sampling_params, stream)
        if req.error:
            raise RequestError(req.error)
        req.trace_parent = trace_parent
        return req

    async def generate_request(self, req: TokenizedGenerateReqInput) -> AsyncIterator[ServerReqState]:
        """Send one checked request; yield its state each time more of it came back.
        Closing the iterator early (a client that went away) aborts the request."""
        import asyncio

        state = ServerReqState(req.rid, asyncio.Event(), time.monotonic())
        self.rid_to_state[req.rid] = state
        await self.send_to_scheduler.send_pyobj(req)
        try:
            while not state.finished:
                await state.event.wait()
                state.event.clear()
                yield state
        finally:
            self.rid_to_state.pop(req.rid, None)
            if not state.finished:  # the handler stopped reading (a client that went away)
                self.abort_request(req.rid)
                if self.metrics is not None:
                    self.metrics.num_aborted_requests_total.inc()

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
        import asyncio

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
        import asyncio

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
        if out.new_token_ids:
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
