"""The HTTP server (SGLang: entrypoints/http_server.py): FastAPI routes over the
ServerTokenizerManager, in the main process. SGLang's native routes (/generate, /health,
/health_generate, /get_model_info, /get_server_info, /flush_cache, /abort_request,
/metrics) and OpenAI's (/v1/completions, /v1/chat/completions, /v1/models).

Errors are SGLang's shapes: a bad request is a 400 with ``{"error": {"message"}}`` on
/generate and OpenAI's ``{"object": "error", "message", "type", "param", "code"}`` on
/v1/*; FastAPI's 422 is remapped to 400; inside a stream an error is a ``data:`` event.
A streamed request whose client goes away is aborted (its KV freed at once); a
non-streamed one is aborted when the client disconnects while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from sglite.entrypoints import openai_api as oai
from sglite.managers.io_struct import DebugControlReq, ExplainReq, FlushCacheReqInput, GetInternalStateReq
from sglite.managers.tokenizer_manager import RequestError, ServerReqState, ServerTokenizerManager
from sglite.server_args import ServerArgs

MAX_BATCH = 1024  # requests in one /generate batch
DISCONNECT_POLL = 0.5  # seconds between checks that a waiting non-streamed client is still there


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
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))  # /v1/models' "created": the start


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


def build_app(manager: ServerTokenizerManager, info: ServerInfo) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(manager.handle_loop())
        yield
        task.cancel()

    app = FastAPI(title="sglite", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.manager, app.state.info = manager, info

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad(request, f"invalid request: {exc.errors()[0].get('msg', exc)}")

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return _bad(request, str(exc))

    @app.get("/metrics")
    async def metrics() -> Response:
        if not info.metrics:
            return JSONResponse({"error": {"message": "metrics are off: start with --enable-metrics"}}, 404)
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # every process's sglang:* series
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    _native_routes(app, manager, info)
    _openai_routes(app, manager, info)
    _debug_routes(app, manager, info)
    return app


def _bad(request: Request, message: str, param: str | None = None, code: int = 400) -> JSONResponse:
    if request.url.path.startswith("/v1/"):
        return JSONResponse(oai.error_body(message, param, code), status_code=code)
    return JSONResponse({"error": {"message": message}}, status_code=code)


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


# --- native routes -------------------------------------------------------------------


def _native_routes(app: FastAPI, manager: ServerTokenizerManager, info: ServerInfo) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        req = manager.check(f"health-{uuid.uuid4().hex}", input_ids=[0], sampling_params={"max_new_tokens": 1})
        try:
            await asyncio.wait_for(_collect(manager, req), timeout=60)
        except asyncio.TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

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
        if out.error:
            return JSONResponse({"error": {"message": out.error}}, status_code=404)
        return Response(out.text + "\n", media_type="text/plain")

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache() -> Response:
        out = await manager.control(FlushCacheReqInput())
        return Response(out.message or "Cache flushed.\n", status_code=200 if out.success else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json(request)
        if body.get("abort_all"):
            manager.abort_all()
        elif isinstance(body.get("rid"), str):
            manager.abort_request(body["rid"])
        else:
            raise RequestError('give {"rid": "..."} or {"abort_all": true}')
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _generate(request, manager, parent))


async def _generate(request: Request, manager: ServerTokenizerManager, trace_parent: str) -> Response:
    """SGLang's /generate: {"text" | "input_ids", "sampling_params", "rid", "stream"}; a
    list of texts (or of token-id lists) is a batch: one result each, in order (streamed:
    each event carries its request's "index")."""
    body = await _json(request)
    unknown = set(body) - {"text", "input_ids", "sampling_params", "rid", "stream"}
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(sorted(unknown))}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false")
    batch = _is_batch(body)
    reqs = []
    for i, (rid, text, ids, params) in enumerate(_batch_items(body, batch)):
        try:  # (nothing is sent before every request of a batch passed)
            reqs.append(manager.check(rid, prompt=text, input_ids=ids, sampling_params=params, stream=stream,
                                      trace_parent=trace_parent))
        except RequestError as e:
            raise RequestError(f"request {i} of the batch: {e}" if batch else str(e)) from None
    if stream:
        events = _native_batch_stream(manager, reqs) if batch else _native_stream(manager, reqs[0])
        return StreamingResponse(events, media_type="text/event-stream")
    states = await asyncio.gather(*(_collect(manager, r, request) for r in reqs))
    results = [_native_result(s) for s in states]
    return JSONResponse(results if batch else results[0])


def _is_batch(body: dict[str, Any]) -> bool:
    """A list of texts, or a list of token-id lists (SGLang's batch form)."""
    ids = body.get("input_ids")
    return isinstance(body.get("text"), list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))


def _batch_items(body: dict[str, Any], batch: bool) -> list[tuple[str, Any, Any, Any]]:
    """(rid, text, input_ids, sampling_params) of each request the body asks for. In a
    batch, ``sampling_params`` is one dict for all or a list of one each, and ``rid``
    (optional) a list of one each."""
    rid, params = body.get("rid"), body.get("sampling_params")
    if not batch:
        rid = rid or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise RequestError("rid must be a string")
        return [(rid, body.get("text"), body.get("input_ids"), params)]
    field = "text" if body.get("text") is not None else "input_ids"
    prompts = body[field]
    n = len(prompts)
    if not n or n > MAX_BATCH:
        raise RequestError(f"a batch holds 1 to {MAX_BATCH} requests, got {n}")
    rids = [uuid.uuid4().hex for _ in range(n)] if rid is None else rid
    if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) for r in rids):
        raise RequestError(f"rid must be a list of {n} strings for a batch of {n}")
    if len(set(rids)) != n:
        raise RequestError("the rids of a batch must differ")
    if isinstance(params, list) and len(params) != n:
        raise RequestError(f"sampling_params must be one dict, or a list of {n}, for a batch of {n}")
    each = params if isinstance(params, list) else [params] * n
    return [(r, p if field == "text" else None, p if field == "input_ids" else None, sp)
            for r, p, sp in zip(rids, prompts, each)]


def _native_result(state: ServerReqState) -> dict[str, Any]:
    meta = {"id": state.rid, **state.meta_info}
    out = {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
    if "error" in meta:
        out["error"] = {"message": meta["error"]}
    return out


async def _native_stream(manager: ServerTokenizerManager, req: Any) -> AsyncIterator[bytes]:
    """Cumulative text per event, as SGLang streams it, then [DONE]."""
    async for state in manager.generate_request(req):
        yield f"data: {json.dumps(_native_result(state))}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _native_batch_stream(manager: ServerTokenizerManager, reqs: list[Any]) -> AsyncIterator[bytes]:
    """A batch: each request's cumulative result as it comes, with its "index", then [DONE]."""
    async with contextlib.aclosing(_merge(manager, reqs, lambda i, s: _native_result(s) | {"index": i})) as events:
        async for _, event, _ in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _merge(manager: ServerTokenizerManager, reqs: list[Any], snap: Callable[[int, ServerReqState], Any]
                 ) -> AsyncIterator[tuple[int, Any, dict[str, Any] | None]]:
    """Several requests' progress as it comes: (index, ``snap(index, state)`` taken when
    the state came, its meta_info once that request finished, else None), until every
    request finished. Closing it early aborts those still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, req: Any) -> None:
        async for state in manager.generate_request(req):
            await queue.put((index, snap(index, state), state.meta_info if state.finished else None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        done = 0
        while done < len(reqs):
            item = await queue.get()
            done += item[2] is not None
            yield item
    finally:
        for t in tasks:
            t.cancel()  # a client that went away: each request's generator aborts it


async def _collect(manager: ServerTokenizerManager, req: Any, request: Request | None = None) -> ServerReqState:
    """Run a request to the end. A client that disconnects while it waits gets its
    request aborted (the scheduler frees its KV and answers with an abort)."""
    watcher = asyncio.create_task(_abort_on_disconnect(manager, req.rid, request)) if request is not None else None
    try:
        async for state in manager.generate_request(req):
            if state.finished:
                return state
        raise AssertionError("a request's outputs ended before it finished")
    finally:
        if watcher is not None:
            watcher.cancel()


async def _abort_on_disconnect(manager: ServerTokenizerManager, rid: str, request: Request) -> None:
    while True:
        await asyncio.sleep(DISCONNECT_POLL)
        if await request.is_disconnected():
            manager.abort_request(rid)
            return


# --- debug routes (sglite tui --attach) ----------------------------------------------


def _debug_routes(app: FastAPI, manager: ServerTokenizerManager, info: ServerInfo) -> None:
    @app.get("/debug/events")
    async def debug_events() -> StreamingResponse:
        """The scheduler's events as server-sent events, one JSON list per shipment
        (every iteration's events; the newest of each with a SchedulerSnapshot)."""
        return StreamingResponse(_event_stream(info.events_address), media_type="text/event-stream")

    @app.post("/debug/control")
    async def debug_control(request: Request) -> Response:
        if not info.debug_control:
            return JSONResponse({"error": {"message": "pause and step need the server to be started with "
                                                      "--enable-debug-control"}}, 403)
        cmd = (await _json(request)).get("cmd")
        if cmd not in ("pause", "run", "step", "status"):
            raise RequestError(f'cmd must be "pause", "run", "step" or "status", got {cmd!r}')
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
                "root": info.server_args.model_path}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Any:
        if model != info.model_name:
            return JSONResponse(oai.error_body(f"The model '{model}' does not exist", "model", 404,
                                               "NotFoundError") | {"code": "model_not_found"}, 404)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _openai(request, manager, info, False, parent))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _traced(request, info, lambda parent: _openai(request, manager, info, True, parent))

    @app.exception_handler(oai.OpenAIError)
    async def openai_error(request: Request, exc: oai.OpenAIError) -> JSONResponse:
        return _bad(request, str(exc), exc.param)


async def _openai(request: Request, manager: ServerTokenizerManager, info: ServerInfo, chat: bool,
                  trace_parent: str) -> Response:
    body = await _json(request)
    params, n = oai.sampling_params(body, chat)
    inputs = [{"messages": body.get("messages")}] if chat else oai.prompts_of(body)
    rid = oai.new_id("chatcmpl" if chat else "cmpl")
    reqs = [manager.check(f"{rid}-{i}-{k}", **inp, sampling_params=params, stream=bool(body.get("stream")),
                          trace_parent=trace_parent)
            for i, inp in enumerate(inputs) for k in range(n)]
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_openai_stream(manager, reqs, rid, info.model_name, chat, include_usage),
                                 media_type="text/event-stream")
    states = await asyncio.gather(*(_collect(manager, r, request) for r in reqs))
    errors = [s.meta_info["error"] for s in states if "error" in s.meta_info]
    if errors:  # (a round that failed inside the scheduler)
        return JSONResponse(oai.error_body(errors[0], code=500, kind="InternalServerError"), 500)
    texts, metas = [s.text for s in states], [s.meta_info for s in states]
    shape = oai.chat_response if chat else oai.completion_response
    return JSONResponse(shape(rid, info.model_name, texts, metas))


async def _openai_stream(manager: ServerTokenizerManager, reqs: list[Any], rid: str, model: str, chat: bool,
                         include_usage: bool) -> AsyncIterator[bytes]:
    """Deltas of every choice as they come, each choice's finish_reason, then usage
    (when asked) and [DONE]. Leaving early aborts every choice still running."""
    started: set[int] = set()

    def chunk(index: int, state: ServerReqState) -> dict[str, Any]:
        text = "".join(o.new_text for o in state.outs)
        state.outs.clear()
        reason = oai.finish_reason(state.meta_info) if state.finished else None
        first = index not in started
        started.add(index)
        return oai.stream_chunk(rid, model, chat, index, text, reason, first)

    metas: list[dict[str, Any]] = []
    async with contextlib.aclosing(_merge(manager, reqs, chunk)) as events:
        async for _, event, meta in events:
            yield f"data: {json.dumps(event)}\n\n".encode()
            if meta is not None:
                metas.append(meta)
                if "error" in meta:
                    yield f"data: {json.dumps({'error': oai.error_body(meta['error'])})}\n\n".encode()
    if include_usage:
        last = oai.stream_chunk(rid, model, chat, 0, None, None) | {"choices": [], "usage": oai.usage(metas)}
        yield f"data: {json.dumps(last)}\n\n".encode()
    yield b"data: [DONE]\n\n"
