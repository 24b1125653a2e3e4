"""The HTTP server (SGLang: entrypoints/http_server.py): FastAPI routes over the
ServerTokenizerManager, in the main process. SGLang's native routes (/generate, /health,
/health_generate, /get_model_info, /get_server_info, /flush_cache, /abort_request,
/metrics) and OpenAI's (/v1/completions, /v1/chat/completions, /v1/models).

Errors are SGLang's shapes: a bad request is a 400 with ``{"error": {"message"}}`` on
/generate and OpenAI's ``{"object": "error", "message", "type", "param", "code"}`` on
/v1/*; FastAPI's 422 is remapped to 400; inside a stream an error is a ``data:`` event.
A streamed request whose client goes away is aborted (its KV freed at once); a
non-streamed one is aborted when the client disconnects while it waits. What a request
passes before a route sees it (Host, Origin, API key, media type, body size) is
http_security.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from sglite.entrypoints import openai_api as oai
from sglite.entrypoints import protocol
from sglite.entrypoints import responses_api as rapi
from sglite.entrypoints.http_security import HttpGuard, SecurityPolicy, parse_json, start_json_worker
from sglite.managers.io_struct import (HEALTH_CHECK_RID_PREFIX, DebugControlReq, ExplainReq, FlushCacheReqInput,
                                       GetInternalStateReq, LogprobParams)
from sglite.managers.tokenizer_manager import (LOGPROB_FIELDS, Claim, ReqSpec, RequestError, ServerReqState,
                                               ServerTokenizerManager, logprob_params_each)
from sglite.sampling.sampling_params import check_utf8
from sglite.server_args import ServerArgs

MAX_BATCH = oai.MAX_BATCH  # requests in one body: a /generate batch, or prompts x n of an OpenAI request
DISCONNECT_POLL = 0.5  # seconds between checks that a waiting non-streamed client is still there

logger = logging.getLogger("sglite")


@dataclasses.dataclass
class ServerInfo:
    server_args: ServerArgs
    model_name: str
    max_total_num_tokens: int
    max_req_input_len: int
    metrics: bool
    http_spans: Any = None  # the tracing plugin's HttpSpans: one SERVER span per generation request
    events_address: str = ""  # the scheduler's event stream (ZMQ), for /debug/events
    debug_control: bool = False  # /debug/control may pause and step the scheduler
    debug_events: bool = False  # /debug/events may stream every request's prompt and output
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))  # /v1/models' "created": the start
    # SGLang's ServerStatus: "starting" until a first health probe passed, then "up";
    # "shutting_down" once the server stops. /health answers 503 unless "up".
    status: str = "starting"
    health_check_timeout: float = 20.0  # seconds a health probe may wait (SGLANG_HEALTH_CHECK_TIMEOUT)


TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


async def _traced(request: Request, info: ServerInfo, handler: Callable[[str], Awaitable[Response]]) -> Response:
    """Run ``handler(traceparent)``: the request's spans in the scheduler continue the
    client's trace (its W3C ``traceparent`` header) under this server's span for the
    HTTP request, which ends once the response (a whole stream) has been sent."""
    incoming = request.headers.get("traceparent", "").strip().lower()
    if info.http_spans is None:
        return await handler(incoming if TRACEPARENT.match(incoming) else "")
    parent, end = info.http_spans.start(request.method, request.url.path, dict(request.headers))
    try:
        response = await handler(parent)
    except BaseException as e:
        end(None, str(e))
        raise
    response.background = BackgroundTask(end, response.status_code)
    return response


def build_app(manager: ServerTokenizerManager, info: ServerInfo, policy: SecurityPolicy | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(manager.handle_loop()), asyncio.create_task(_warm_up(manager, info))]
        yield
        for task in tasks:
            task.cancel()
        if getattr(app.state, "json_pool", None) is not None:
            app.state.json_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="sglite", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.manager, app.state.info = manager, info
    app.add_middleware(HttpGuard, policy=policy or SecurityPolicy())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad(request, f"invalid request: {exc.errors()[0].get('msg', exc)}")

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return _bad(request, str(exc), oai.param_of(str(exc)))

    @app.get("/metrics")
    async def metrics() -> Response:
        if not info.metrics:
            return JSONResponse({"error": {"message": "metrics are off: start with --enable-metrics"}}, 404)
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # every process's sglang:* series
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    _native_routes(app, manager, info)
    _token_routes(app, manager)
    _openai_routes(app, manager, info)
    _debug_routes(app, manager, info)
    _describe_bodies(app)
    return app


def _describe_bodies(app: FastAPI) -> None:
    """/openapi.json with the request bodies' models (protocol.py): the routes read raw
    JSON, so FastAPI cannot see them itself."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(protocol.component_schemas())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bad(request: Request, message: str, param: str | None = None, code: int = 400) -> Response:
    if request.url.path.startswith("/v1/"):
        return _ascii_json(oai.error_body(message, param, code), code)
    return _ascii_json({"error": {"message": message}}, code)


def _ascii_json(content: Any, status: int) -> Response:
    """JSON with every non-ASCII character escaped: an error may quote what a client
    sent, and a lone surrogate there could not be encoded as UTF-8."""
    return Response(json.dumps(content), status_code=status, media_type="application/json")


# Bodies up to this size are parsed on the event loop (under ~20 ms); bigger ones in a
# worker process, since the parser holds the GIL throughout: 30 MB of token ids took
# 0.6 s, every other client waiting (benchmarks/server_guard.py).
INLINE_JSON_BYTES = 1 << 20


async def _json(request: Request) -> dict[str, Any]:
    """The body as a JSON object (HttpGuard has checked its media type and size)."""
    raw = await request.body()
    status, body = parse_json(raw) if len(raw) <= INLINE_JSON_BYTES else await _parse_off_loop(request.app, raw)
    if status == "error":
        raise RequestError(body)
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


async def _parse_off_loop(app: FastAPI, raw: bytes) -> tuple[str, Any]:
    from concurrent.futures.process import BrokenProcessPool

    try:
        return await asyncio.get_running_loop().run_in_executor(_json_pool(app), parse_json, raw)
    except BrokenProcessPool:  # the worker died (killed, out of memory): a new one next time
        app.state.json_pool = None
        return parse_json(raw)


def _json_pool(app: FastAPI) -> Any:
    """The app's JSON-parsing worker process (started on first use, stopped with the app)."""
    if getattr(app.state, "json_pool", None) is None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        app.state.json_pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=start_json_worker)
    return app.state.json_pool


def _flag(body: dict[str, Any], name: str) -> bool:
    """A boolean field: true, false or absent/null (false). "false", 0 or "no" are not
    booleans: refusing them is safer than guessing ({"abort_all": "no"} once aborted all)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {json.dumps(value)[:80]}")
    return value


# --- tokenize / detokenize ----------------------------------------------------------


def _token_routes(app: FastAPI, manager: ServerTokenizerManager) -> None:
    """SGLang's /tokenize and /detokenize (also under /v1): the served model's tokenizer,
    on the tokenizing thread (a long text costs its own wait, not the event loop's)."""

    @app.post("/tokenize", openapi_extra=protocol.body(protocol.TokenizeRequest))
    @app.post("/v1/tokenize", openapi_extra=protocol.body(protocol.TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        body = await _json(request)
        _known(body, {"model", "prompt", "add_special_tokens"})
        prompt, tokenizer, special = body.get("prompt"), _tokenizer(manager), body.get("add_special_tokens", True)
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise RequestError("prompt must be a string or a list of strings")
        if not isinstance(special, bool):
            raise RequestError("add_special_tokens must be true or false")
        for t in texts:
            check_utf8("the prompt", t)
        ids = await asyncio.get_running_loop().run_in_executor(
            manager.tokenize_pool, lambda: [tokenizer.encode(t, special) for t in texts])
        one = isinstance(prompt, str)
        return JSONResponse({"tokens": ids[0] if one else ids, "count": len(ids[0]) if one else [len(i) for i in ids],
                             "max_model_len": manager.gate.context_len})

    @app.post("/detokenize", openapi_extra=protocol.body(protocol.DetokenizeRequest))
    @app.post("/v1/detokenize", openapi_extra=protocol.body(protocol.DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        body = await _json(request)
        _known(body, {"model", "tokens", "skip_special_tokens"})
        tokens, skip, tokenizer = body.get("tokens"), body.get("skip_special_tokens", True), _tokenizer(manager)
        lists = tokens if isinstance(tokens, list) and tokens and isinstance(tokens[0], list) else [tokens]
        vocab = manager.gate.vocab_size
        if not all(isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids) for ids in lists):
            raise RequestError(f"Invalid input: 'tokens' must be a list of integers (token ids 0..{vocab - 1}).")
        if not isinstance(skip, bool):
            raise RequestError("skip_special_tokens must be true or false")
        texts = await asyncio.get_running_loop().run_in_executor(
            manager.tokenize_pool, lambda: [tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists])
        return JSONResponse({"text": texts if lists is tokens else texts[0]})


def _known(body: dict[str, Any], fields: set[str]) -> None:
    """RequestError naming the body's fields outside ``fields``."""
    unknown = set(body) - fields
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(sorted(map(repr, unknown)))}")


def _tokenizer(manager: ServerTokenizerManager) -> Any:
    if manager.gate.tokenizer is None:
        raise RequestError("this model has no tokenizer")
    return manager.gate.tokenizer


# --- native routes -------------------------------------------------------------------


def _native_routes(app: FastAPI, manager: ServerTokenizerManager, info: ServerInfo) -> None:
    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        """SGLang's health_generate (both routes): 200 once the scheduler answered a
        one-token probe, or was producing tokens anyway; 503 while starting or shutting
        down, when the probe was aborted, or after health_check_timeout seconds."""
        if info.status != "up":
            return Response(f"the server is {info.status.replace('_', ' ')}\n", status_code=503)
        return Response(status_code=200 if await _probe(manager, info.health_check_timeout) else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": info.server_args.model_path, "tokenizer_path": info.server_args.model_path,
                "is_generation": True}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        state = await manager.control(GetInternalStateReq())
        return {**dataclasses.asdict(info.server_args), "max_total_num_tokens": info.max_total_num_tokens,
                "max_req_input_len": info.max_req_input_len, "internal_states": [state.internal_state],
                "version": "sglite 0.1.0"}

    @app.get("/explain")
    async def explain(rid: str) -> Response:
        """sglite's own route: a request's history in words (docs/why.md)."""
        out = await manager.control(ExplainReq(rid))
        if out.error and re.fullmatch(r"(chatcmpl|cmpl)-[0-9a-f]+", rid):
            # an OpenAI response's id: its choices ran as <id>-<prompt>-<sample>
            first = await manager.control(ExplainReq(f"{rid}-0-0"))
            if not first.error:
                return Response(f"(the OpenAI id {rid}: its first choice ran as {rid}-0-0; the others as "
                                f"{rid}-<prompt>-<sample>)\n{first.text}\n", media_type="text/plain")
        if out.error:
            return JSONResponse({"error": {"message": out.error}}, status_code=404)
        return Response(out.text + "\n", media_type="text/plain")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        out = await manager.control(FlushCacheReqInput())
        return Response(out.message or "Cache flushed.\n", status_code=200 if out.success else 400)

    @app.post("/abort_request", openapi_extra=protocol.body(protocol.AbortReqInput))
    async def abort_request(request: Request) -> Response:
        body = await _json(request)
        if _flag(body, "abort_all"):
            manager.abort_all()
        elif isinstance(body.get("rid"), str):
            manager.abort_request(body["rid"])
        else:
            raise RequestError('give {"rid": "..."} or {"abort_all": true}')
        return Response(status_code=200)

    @app.post("/generate", openapi_extra=protocol.body(protocol.GenerateReqInput))
    async def generate(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _generate(request, manager, parent))


async def _generate(request: Request, manager: ServerTokenizerManager, trace_parent: str) -> Response:
    """SGLang's /generate: {"text" | "input_ids", "sampling_params", "rid", "stream",
    "extra_key" | "cache_salt"}; a list of texts (or of token-id lists) is a batch: one
    result each, in order (streamed: each event carries its request's "index")."""
    body = await _json(request)
    _known(body, GENERATE_FIELDS)
    stream = _flag(body, "stream")
    batch = _is_batch(body)
    specs = _batch_items(body, batch, stream, oai.extra_key_of(body))
    if any(_samples(sp.sampling_params) > 1 for sp in specs):
        specs, batch = _parallel_samples(specs), True
    claim = await manager.submit(specs, trace_parent, batch)  # (nothing is sent before every request passed)
    with_text = manager.gate.tokenizer is not None  # (--skip-tokenizer-init: ids only, as SGLang's)
    if stream:
        shape = NativeChunks(request.app.state.info.server_args.incremental_streaming_output, with_text)
        events = _native_batch_stream(manager, claim, shape) if batch else _native_stream(manager, claim, shape)
        return StreamingResponse(ClaimedStream(events, claim), media_type="text/event-stream")
    states, failed = await _run_to_end(manager, claim, request, round_failure_is_error=False)
    if failed is not None:
        return failed
    results = [_native_result(s, with_text) for s in states]
    return JSONResponse(results if batch else results[0])


async def _run_to_end(manager: ServerTokenizerManager, claim: Claim, request: Request,
                      round_failure_is_error: bool = True) -> tuple[list[ServerReqState], Response | None]:
    """Run the claim's requests to their end (then release it), with the error response
    due instead of a result, if any: a request aborted with an HTTP status (503), or one
    whose round failed inside the scheduler (500; /generate keeps those in its result)."""
    try:
        states = await _collect_all(manager, claim, request)
    finally:
        claim.release()
    errors = [s.meta_info["error"] for s in states if "error" in s.meta_info]
    if errors and round_failure_is_error:
        return states, _ascii_json(oai.error_body(errors[0], code=500, kind="InternalServerError"), 500)
    return states, _status_error(states)


def _status_error(states: list[ServerReqState]) -> Response | None:
    """SGLang's answer to a request the scheduler aborted with an HTTP status (503: a
    waiting or running timeout): that status and an error body, not a result."""
    for state in states:
        reason = state.meta_info.get("finish_reason") or {}
        if reason.get("status_code"):
            code = int(reason["status_code"])
            return _ascii_json(oai.error_body(reason.get("message", ""), code=code, kind=str(code)), code)
    return None


GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "stream", "extra_key", "cache_salt",
                   *LOGPROB_FIELDS}


def _is_batch(body: dict[str, Any]) -> bool:
    """A list of texts, or a list of token-id lists (SGLang's batch form)."""
    ids = body.get("input_ids")
    return isinstance(body.get("text"), list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))


def _batch_items(body: dict[str, Any], batch: bool, stream: bool, extra_key: str | None) -> list[ReqSpec]:
    """Each request the body asks for. In a batch, ``sampling_params`` is one dict for
    all or a list of one each, and ``rid`` (optional) a list of one each."""
    rid, params = body.get("rid"), body.get("sampling_params")
    if body.get("text") is not None and body.get("input_ids") is not None:
        raise RequestError("give only one of text or input_ids (got both)")
    if not batch:
        rid = uuid.uuid4().hex if rid is None else rid
        logprob = logprob_params_each(1, **{k: body[k] for k in LOGPROB_FIELDS if k in body})[0]
        return [ReqSpec(rid, body.get("text"), body.get("input_ids"), None, params, stream, extra_key, logprob)]
    field = "text" if body.get("text") is not None else "input_ids"
    prompts = body[field]
    n = len(prompts)
    if not n or n > MAX_BATCH:
        raise RequestError(f"a batch holds 1 to {MAX_BATCH} requests, got {n}")
    logprobs = logprob_params_each(n, **{k: body[k] for k in LOGPROB_FIELDS if k in body})
    rids = [uuid.uuid4().hex for _ in range(n)] if rid is None else rid
    if not isinstance(rids, list) or len(rids) != n:
        raise RequestError(f"rid must be a list of {n} strings for a batch of {n}")
    if isinstance(params, list) and len(params) != n:
        raise RequestError(f"sampling_params must be one dict, or a list of {n}, for a batch of {n}")
    each = params if isinstance(params, list) else [params] * n
    return [ReqSpec(r, p if field == "text" else None, p if field == "input_ids" else None, None, sp, stream,
                    extra_key, lp) for r, p, sp, lp in zip(rids, prompts, each, logprobs)]


def _samples(params: Any) -> int:
    """sampling_params' n (SGLang's parallel samples); the gate checks anything odd."""
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= oai.MAX_N else 1


def _parallel_samples(specs: list[ReqSpec]) -> list[ReqSpec]:
    """n samples of each request, in SGLang's order (a0, a1, b0, b1): each its own
    request (its own rid: the given one with -k, else a fresh one) with n = 1."""
    out = []
    for spec in specs:
        n = _samples(spec.sampling_params)
        params = dict(spec.sampling_params, n=1) if isinstance(spec.sampling_params, dict) else spec.sampling_params
        if len(out) + n > MAX_BATCH:
            raise RequestError(f"the samples of this body make more than {MAX_BATCH} requests")
        out += [dataclasses.replace(spec, rid=f"{spec.rid}-{k}", sampling_params=params) for k in range(n)]
    return out


def _native_result(state: ServerReqState, with_text: bool = True) -> dict[str, Any]:
    """A /generate result; ``with_text`` False (--skip-tokenizer-init): no "text", as SGLang's."""
    meta = {"id": state.rid, **state.result_meta()}
    out = {"text": state.text} if with_text else {}
    out |= {"output_ids": list(state.output_ids), "meta_info": meta}
    if "error" in meta:
        out["error"] = {"message": meta["error"]}
    return out


class ClaimedStream:
    """A streamed response's body: the events of ``events``; whenever it ends, is
    closed, or is dropped unread (a client gone before the first event), its requests'
    claim is released: those unfinished are aborted and their rids freed."""

    def __init__(self, events: AsyncIterator[bytes], claim: Claim):
        self.events, self.claim = events, claim

    def __aiter__(self) -> "ClaimedStream":
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.events.__anext__()
        except BaseException:
            self.claim.release()
            raise

    async def aclose(self) -> None:
        self.claim.release()
        await self.events.aclose()  # type: ignore[attr-defined]


class NativeChunks:
    """A streamed /generate's events: each request's result so far (SGLang's default),
    or with --incremental-streaming-output only what is new since its last event (text,
    output_ids and the output logprob keys; the rest of meta_info as it is)."""

    INCREMENTAL_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")

    def __init__(self, incremental: bool, with_text: bool = True):
        self.incremental, self.with_text = incremental, with_text
        self.sent: dict[str, tuple[int, int]] = {}  # rid -> (characters, tokens) sent

    def __call__(self, state: ServerReqState) -> dict[str, Any]:
        out = _native_result(state, self.with_text)
        if not self.incremental:
            return out
        chars, tokens = self.sent.get(state.rid, (0, 0))
        self.sent[state.rid] = (len(state.text), len(state.output_ids))
        meta = {k: v[tokens:] if k in self.INCREMENTAL_KEYS else v for k, v in out["meta_info"].items()}
        out |= {"text": state.text[chars:]} if self.with_text else {}
        return out | {"output_ids": out["output_ids"][tokens:], "meta_info": meta}


async def _native_stream(manager: ServerTokenizerManager, claim: Claim, shape: NativeChunks) -> AsyncIterator[bytes]:
    """The request's result per event (cumulative by default, as SGLang streams it), then [DONE]."""
    async for state in manager.results(claim.states[0]):
        yield f"data: {json.dumps(shape(state))}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _native_batch_stream(manager: ServerTokenizerManager, claim: Claim, shape: NativeChunks
                               ) -> AsyncIterator[bytes]:
    """A batch: each request's result as it comes (see NativeChunks), with its "index", then [DONE]."""
    async with contextlib.aclosing(_merge(manager, claim, lambda i, s: shape(s) | {"index": i})) as events:
        async for _, event, _ in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _merge(manager: ServerTokenizerManager, claim: Claim, snap: Callable[[int, ServerReqState], Any]
                 ) -> AsyncIterator[tuple[int, Any, dict[str, Any] | None]]:
    """Several requests' progress as it comes: (index, ``snap(index, state)`` taken when
    the state came, its meta_info once that request finished, else None), until every
    request finished. Closing it early releases the claim (aborting those unfinished)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, state: ServerReqState) -> None:
        async for st in manager.results(state):
            await queue.put((index, snap(index, st), st.meta_info if st.finished else None))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(claim.states)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            done += item[2] is not None
            yield item
    finally:
        for t in tasks:
            t.cancel()
        claim.release()


async def _collect_all(manager: ServerTokenizerManager, claim: Claim, request: Request) -> list[ServerReqState]:
    """Run every request of the claim to its end. A client that disconnects while it
    waits gets them aborted (the scheduler frees their KV and answers with an abort)."""
    watcher = asyncio.create_task(_abort_on_disconnect(manager, claim, request))
    try:
        for state in claim.states:
            async for _ in manager.results(state):
                pass
        return claim.states
    finally:
        watcher.cancel()


async def _abort_on_disconnect(manager: ServerTokenizerManager, claim: Claim, request: Request) -> None:
    while True:
        await asyncio.sleep(DISCONNECT_POLL)
        if await request.is_disconnected():
            for state in claim.states:
                if not state.finished:
                    manager.abort_request(state.rid)
            return


# --- health ----------------------------------------------------------------------------


async def _probe(manager: ServerTokenizerManager, timeout: float) -> bool:
    """SGLang's health check: a one-token request the scheduler must answer within
    ``timeout`` seconds. A busy scheduler answers it at once without running it; tokens
    of any other request arriving meanwhile pass it too (the scheduler is producing
    output). An aborted probe fails."""
    tic = time.monotonic()
    spec = ReqSpec(f"{HEALTH_CHECK_RID_PREFIX}{time.time_ns()}", input_ids=[0],
                   sampling_params={"max_new_tokens": 1, "temperature": 0})
    claim = await manager.submit([spec])
    state = claim.states[0]
    try:
        while time.monotonic() - tic < timeout:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.event.wait(), timeout=min(0.5, timeout))
            if state.finished:
                return (state.meta_info.get("finish_reason") or {}).get("type") != "abort"
            if manager.last_output_tstamp > tic:
                return True
        return False
    finally:
        claim.release()


async def _warm_up(manager: ServerTokenizerManager, info: ServerInfo) -> None:
    """The server is up once a first probe passed (SGLang's warmup); until then /health
    answers 503."""
    while info.status == "starting":
        if await _probe(manager, info.health_check_timeout):
            info.status = "up"
            logger.info("The server is fired up and ready to roll!")  # SGLang's line
        else:
            await asyncio.sleep(1.0)


# --- debug routes (sglite tui --attach) ----------------------------------------------


def _debug_routes(app: FastAPI, manager: ServerTokenizerManager, info: ServerInfo) -> None:
    @app.get("/debug/events")
    async def debug_events() -> Response:
        """The scheduler's events as server-sent events, one JSON list per shipment
        (every iteration's events; the newest of each with a SchedulerSnapshot). They
        hold every request's prompt ids and output text: off unless the server was
        started with --enable-debug-events (and behind --api-key when one is set)."""
        if not info.debug_events:
            return JSONResponse({"error": {"message": "the event stream shows every client's prompts and outputs: "
                                                      "start the server with --enable-debug-events to allow it"}}, 403)
        return StreamingResponse(_event_stream(info.events_address), media_type="text/event-stream")

    @app.post("/debug/control", openapi_extra=protocol.body(protocol.DebugControlInput))
    async def debug_control(request: Request) -> Response:
        if not info.debug_control:
            return JSONResponse({"error": {"message": "pause and step need the server to be started with "
                                                      "--enable-debug-control"}}, 403)
        cmd = (await _json(request)).get("cmd")
        if cmd not in ("pause", "run", "step", "status"):
            raise RequestError(f'cmd must be "pause", "run", "step" or "status", got {json.dumps(cmd)[:80]}')
        out = await manager.control(DebugControlReq(cmd))
        return JSONResponse({"paused": out.paused, "iteration": out.iteration})


async def _event_stream(address: str) -> AsyncIterator[bytes]:
    import zmq
    import zmq.asyncio

    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sock.connect(address)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        yield b": sglite scheduler events\n\n"  # the stream is open (the first shipment comes with work)
        while True:
            events = await sock.recv_pyobj()
            yield f"data: {json.dumps([e.to_dict() for e in events])}\n\n".encode()
    finally:
        sock.close(linger=0)  # the scheduler stops publishing when its last reader goes


# --- OpenAI routes -------------------------------------------------------------------


def _openai_routes(app: FastAPI, manager: ServerTokenizerManager, info: ServerInfo) -> None:
    def model_card() -> dict[str, Any]:
        return {"id": info.model_name, "object": "model", "created": info.created, "owned_by": "sglite",
                "root": info.server_args.model_path, "parent": None, "max_model_len": manager.gate.context_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Any:
        if model != info.model_name:
            return JSONResponse(oai.error_body(f"The model '{model}' does not exist", "model", 404,
                                               "NotFoundError") | {"code": "model_not_found"}, 404)
        return model_card()

    @app.post("/v1/completions", openapi_extra=protocol.body(protocol.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _openai(request, manager, info, False, parent))

    @app.post("/v1/chat/completions", openapi_extra=protocol.body(protocol.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _openai(request, manager, info, True, parent))

    @app.post("/v1/responses", openapi_extra=protocol.body(protocol.ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _responses(request, manager, info, parent))

    @app.post("/v1/score", openapi_extra=protocol.body(protocol.ScoringRequest))
    async def score(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _score(request, manager, info, parent))

    @app.exception_handler(oai.OpenAIError)
    async def openai_error(request: Request, exc: oai.OpenAIError) -> JSONResponse:
        return _bad(request, str(exc), exc.param)


async def _openai(request: Request, manager: ServerTokenizerManager, info: ServerInfo, chat: bool,
                  trace_parent: str) -> Response:
    body = await _json(request)
    params, n = oai.sampling_params(body, chat)
    stream, include_usage = oai.stream_options(body)
    logprob, echo = oai.logprob_params(body, chat), not chat and oai.echo_of(body)
    inputs = [{"messages": body.get("messages")}] if chat else oai.prompts_of(body)
    if len(inputs) * n > MAX_BATCH:
        raise oai.OpenAIError(f"{len(inputs)} prompts x n={n} make {len(inputs) * n} requests; at most {MAX_BATCH} "
                              "in one body", "n" if n > 1 else "prompt")
    rid, extra_key = oai.new_id("chatcmpl" if chat else "cmpl"), oai.extra_key_of(body)
    cont = chat and oai.continue_final_message(body)
    specs = [ReqSpec(f"{rid}-{i}-{k}", inp.get("prompt"), inp.get("input_ids"), inp.get("messages"), params, stream,
                     extra_key, logprob, cont) for i, inp in enumerate(inputs) for k in range(n)]
    claim = await manager.submit(specs, trace_parent)
    echoes = [_echo_text(manager, inputs[i // n]) if echo else "" for i in range(len(specs))]
    if stream:
        events = _openai_stream(manager, claim, OpenAIStream(rid, info.model_name, chat, n, echoes, echo),
                                include_usage)
        return StreamingResponse(ClaimedStream(events, claim), media_type="text/event-stream")
    states, failed = await _run_to_end(manager, claim, request)
    if failed is not None:
        return failed
    texts, metas = [e + s.text for e, s in zip(echoes, states)], [s.result_meta() for s in states]
    if chat:
        return JSONResponse(oai.chat_response(rid, info.model_name, texts, metas, n))
    return JSONResponse(oai.completion_response(rid, info.model_name, texts, metas, n, echo))


async def _score(request: Request, manager: ServerTokenizerManager, info: ServerInfo, trace_parent: str) -> Response:
    """SGLang's /v1/score (decoder-only scoring): each item's prompt runs to its first
    token, whose logprobs of the label tokens are the scores."""
    body = await _json(request)
    prompts, labels, softmax = oai.score_inputs(body, manager.gate.vocab_size)
    if len(prompts) > MAX_BATCH:
        raise oai.OpenAIError(f"at most {MAX_BATCH} items in one body, got {len(prompts)}", "items")
    if not prompts:
        return JSONResponse({"scores": [], "model": info.model_name, "usage": None, "object": "scoring"})
    rid = oai.new_id("score")
    logprob = LogprobParams(True, -1, 0, labels, False)
    params = {"max_new_tokens": 1, "temperature": 0}
    specs = [ReqSpec(f"{rid}-{i}", p.get("prompt"), p.get("input_ids"), None, params, False, None, logprob)
             for i, p in enumerate(prompts)]
    claim = await manager.submit(specs, trace_parent)
    states, failed = await _run_to_end(manager, claim, request)
    if failed is not None:
        return failed
    metas = [s.result_meta() for s in states]
    usage = {"prompt_tokens": sum(m.get("prompt_tokens", 0) for m in metas), "completion_tokens": 0}
    usage["total_tokens"] = usage["prompt_tokens"]
    return JSONResponse({"scores": oai.scores(metas, labels, softmax), "model": info.model_name, "usage": usage,
                         "object": "scoring"})


async def _responses(request: Request, manager: ServerTokenizerManager, info: ServerInfo,
                     trace_parent: str) -> Response:
    """OpenAI's /v1/responses for plain text (responses_api.py): a chat request, answered
    as a ``response`` object or streamed as ``response.*`` events."""
    body = await _json(request)
    messages, params, stream = rapi.parse(body)
    params.setdefault("max_new_tokens", oai.NO_LIMIT)
    rid, msg_id = rapi.new_ids()
    claim = await manager.submit([ReqSpec(rid, None, None, messages, params, stream)], trace_parent)
    if stream:
        events = _responses_stream(manager, claim, rapi.EventStream(rid, msg_id, info.model_name, body))
        return StreamingResponse(ClaimedStream(events, claim), media_type="text/event-stream")
    states, failed = await _run_to_end(manager, claim, request)
    if failed is not None:
        return failed
    state = states[0]
    return JSONResponse(rapi.response(rid, msg_id, info.model_name, body, state.text, state.meta_info))


async def _responses_stream(manager: ServerTokenizerManager, claim: Claim, events: "rapi.EventStream"
                            ) -> AsyncIterator[bytes]:
    for opening in events.opening():
        yield opening
    state, text = claim.states[0], ""
    async for _ in manager.results(state):
        new = "".join(o.new_text for o in state.outs)
        state.outs.clear()
        if new:
            text += new
            yield events.delta(new)
    error = oai.stream_error(state.meta_info)
    if error is not None:
        yield events.event("error", code=error["code"], message=error["message"], param=None)
        return
    for closing in events.closing(text, state.meta_info):
        yield closing


def _echo_text(manager: ServerTokenizerManager, inp: dict[str, Any]) -> str:
    """A completion's prompt as ``echo`` repeats it: the string, or its token ids decoded."""
    if inp.get("prompt") is not None:
        return inp["prompt"]
    tokenizer = manager.gate.tokenizer
    return tokenizer.decode(inp["input_ids"], skip_special_tokens=True) if tokenizer is not None else ""


@dataclasses.dataclass
class OpenAIStream:
    """What a streamed completion or chat needs to shape its events."""

    rid: str
    model: str
    chat: bool
    n: int
    echoes: list[str]  # per choice, the text its first event starts with ("" without echo)
    echo: bool = False


async def _openai_stream(manager: ServerTokenizerManager, claim: Claim, how: OpenAIStream,
                         include_usage: bool) -> AsyncIterator[bytes]:
    """Deltas of every choice as they come, each with the logprobs of its new tokens
    when asked, each choice's finish_reason, then usage (when asked) and [DONE].
    Leaving early aborts every choice still running."""
    sent: dict[int, int] = {}  # choice -> output tokens whose logprobs went out

    def chunk(index: int, state: ServerReqState) -> dict[str, Any]:
        text = "".join(o.new_text for o in state.outs)
        state.outs.clear()
        reason = oai.finish_reason(state.meta_info) if state.finished else None
        first = index not in sent
        start, meta = sent.get(index, 0), state.result_meta()
        sent[index] = len(meta.get("output_token_logprobs", ()))
        logprobs = None
        if sent[index] > start or (how.echo and first):  # (none for an event without new tokens)
            logprobs = (oai.chat_logprobs(meta, start) if how.chat else
                        oai.completion_logprobs(meta, how.echo and first, start))
        if first and how.echoes[index]:
            text = how.echoes[index] + text
        stop = oai.matched_stop(state.meta_info) if state.finished else None
        return oai.stream_chunk(how.rid, how.model, how.chat, index, text, reason, first, logprobs, stop)

    metas: dict[int, dict[str, Any]] = {}
    async with contextlib.aclosing(_merge(manager, claim, chunk)) as events:
        async for index, event, meta in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
            if meta is not None:
                metas[index] = meta
                error = oai.stream_error(meta)
                if error is not None:
                    yield f"data: {json.dumps({'error': error})}\n\n".encode()
    if include_usage:
        ordered = [metas[i] for i in sorted(metas)]
        last = oai.stream_chunk(how.rid, how.model, how.chat, 0, None, None) | {
            "choices": [], "usage": oai.usage(ordered, how.n)}
        yield f"data: {json.dumps(last)}\n\n".encode()
    yield b"data: [DONE]\n\n"


