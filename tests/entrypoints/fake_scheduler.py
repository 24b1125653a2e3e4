"""The HTTP process of `sglite serve` in this process, over a stand-in for the scheduler
and detokenizer: a thread on the same ZMQ sockets that answers each request as told
(finish it with one token, leave it unanswered as a stuck scheduler would, abort it).
The server's own code runs unchanged above it (FastAPI app, HttpGuard, the
ServerTokenizerManager and its gate), so these tests check what the HTTP side decides
in milliseconds, without a model; tests/entrypoints/test_http_server.py runs the real
three processes."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from typing import Any

import httpx
import zmq

from sglite.entrypoints.http_security import SecurityPolicy
from sglite.entrypoints.http_server import ServerInfo, build_app
from sglite.managers.io_struct import (AbortReq, BatchStrOut, ExplainReq, ExplainReqOutput, FlushCacheReqInput,
                                       FlushCacheReqOutput, GetInternalStateReq, GetInternalStateReqOutput,
                                       TokenizedGenerateReqInput)
from sglite.managers.tokenizer_manager import ServerTokenizerManager, TokenizerManager
from sglite.model_loader.tiny_random import build_tiny_random
from sglite.server_args import PortArgs, ServerArgs


class FakeScheduler(threading.Thread):
    """``mode``: "answer" (each request finishes at once with token 5 and text "x"),
    "stuck" (nothing is answered, as a scheduler stopped with SIGSTOP, until
    ``answer_held()``), "abort" (each request is answered as aborted). ``received``
    lists every message that came."""

    def __init__(self, port_args: PortArgs):
        super().__init__(daemon=True)
        ctx = zmq.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(port_args.scheduler_input_ipc_name)
        self.outbox = ctx.socket(zmq.PUSH)
        self.outbox.connect(port_args.tokenizer_ipc_name)
        self.mode = "answer"
        self.received: list[Any] = []
        self.held: list[Any] = []
        self.stop, self.release = threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.release.is_set():
                self.release.clear()
                held, self.held = self.held, []
                for m in held:
                    self._answer(m)
            if not self.inbox.poll(20):
                continue
            msg = self.inbox.recv_pyobj()
            self.received.append(msg)
            if self.mode == "stuck":
                self.held.append(msg)
            else:
                self._answer(msg)

    def answer_held(self) -> None:
        """Answer (on the thread that owns the sockets) what "stuck" held."""
        self.release.set()

    def _answer(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            aborted = self.mode == "abort"
            meta = {"id": msg.rid, "prompt_tokens": len(msg.input_ids), "completion_tokens": 0 if aborted else 1,
                    "cached_tokens": 0, "finish_reason": {"type": "abort", "message": "aborted"} if aborted else
                    {"type": "length", "length": 1}}
            self.outbox.send_pyobj([BatchStrOut(msg.rid, "" if aborted else "x", [] if aborted else [5], True, meta)])
        elif isinstance(msg, FlushCacheReqInput):
            self.outbox.send_pyobj(FlushCacheReqOutput(True))
        elif isinstance(msg, GetInternalStateReq):
            self.outbox.send_pyobj(GetInternalStateReqOutput({"iteration": 0}))
        elif isinstance(msg, ExplainReq):
            self.outbox.send_pyobj(ExplainReqOutput("", f"no request {msg.rid!r} in this history"))

    def generate_rids(self) -> list[str]:
        return [m.rid for m in self.received if isinstance(m, TokenizedGenerateReqInput)]

    def aborted_rids(self) -> list[str]:
        return [m.rid for m in self.received if isinstance(m, AbortReq)]


class InProcessServer:
    """The app, its manager and a FakeScheduler; ``client()`` talks to it over ASGI."""

    def __init__(self, policy: SecurityPolicy | None = None, **info: Any):
        self.folder = tempfile.TemporaryDirectory(prefix="sglite-test-")
        port_args = PortArgs.init_new(self.folder.name)
        self.scheduler = FakeScheduler(port_args)
        self.scheduler.start()
        _, _, tokenizer = build_tiny_random()
        gate = TokenizerManager(tokenizer, tokenizer.vocab_size, max_req_input_len=2000, context_len=2048,
                                max_total_num_tokens=4096)
        self.manager = ServerTokenizerManager(gate, port_args, None)
        self.info = ServerInfo(ServerArgs(model_path="tiny-random"), "tiny-random", 4096, 2000, False,
                               **({"status": "up"} | info))
        self.app = build_app(self.manager, self.info, policy)

    async def __aenter__(self) -> "InProcessServer":
        self.loop_task = asyncio.create_task(self.manager.handle_loop())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.loop_task.cancel()
        if getattr(self.app.state, "json_pool", None) is not None:  # (the app's lifespan would stop it)
            self.app.state.json_pool.shutdown(wait=True)
        self.scheduler.stop.set()
        self.scheduler.join(timeout=5)
        self.folder.cleanup()

    def client(self, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://127.0.0.1:30000",
                                 headers=headers, timeout=10)
