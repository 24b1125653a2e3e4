"""OpenAI-compatible request parsing and response shapes (SGLang:
entrypoints/openai/serving_completions.py, serving_chat.py, protocol.py).

A request body becomes sglite sampling parameters here; anything OpenAI defines that
sglite does not do (best_of, suffix, tools) is a 400 naming the parameter, never
silently ignored. Logprobs follow SGLang's adapters: chat ``logprobs`` + ``top_logprobs``,
completions ``logprobs: k`` (+ ``echo``: the prompt's logprobs first, the first one
null), each token's text decoded alone.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from sglite.managers.io_struct import MAX_TOP_LOGPROBS, LogprobParams
from sglite.sampling.sampling_params import UNLIMITED_NEW_TOKENS

# OpenAI parameter -> sglite sampling parameter
SAMPLING_KEYS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "stop": "stop", "seed": "seed", "frequency_penalty": "frequency_penalty",
                 "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
                 "stop_token_ids": "stop_token_ids", "min_tokens": "min_new_tokens", "logit_bias": "logit_bias",
                 # SGLang's extensions: a grammar for the output (response_format's are read below)
                 "regex": "regex", "ebnf": "ebnf", "json_schema": "json_schema"}
IGNORED_KEYS = {"model", "stream", "stream_options", "n", "user",
                "parallel_tool_calls", "service_tier", "store", "metadata",
                "cache_salt", "extra_key"}  # (the last two: extra_key_of)
# what only one route takes (read by prompts_of / the messages, logprob_params, echo_of)
COMPLETION_KEYS = {"prompt", "logprobs", "echo", "response_format"}
CHAT_KEYS = {"messages", "logprobs", "top_logprobs", "continue_final_message", "response_format"}
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""),
               "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none")}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
NO_LIMIT = UNLIMITED_NEW_TOKENS  # a chat's max_new_tokens when none is given (the scheduler caps it at max_req_len)
MAX_N = 16
MAX_BATCH = 1024  # requests one body may make: a /generate batch, or prompts x n here


class OpenAIError(ValueError):
    """A bad request: 400 with OpenAI's error body naming ``param``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def param_of(message: str) -> str | None:
    """The OpenAI parameter a gate error names (its message starts with the sampling
    parameter's name), for the error body's ``param``; None if it names none."""
    head = message.split(" ", 1)[0].split("[", 1)[0]
    if head == "invalid":  # a grammar the gate could not parse: "invalid regex: ..."
        head = message.split(" ", 2)[1].rstrip(":")
    for key, name in SAMPLING_KEYS.items():
        if head == name and key not in ("max_completion_tokens",):
            return key
    return None


def error_body(message: str, param: str | None = None, code: int = 400, kind: str = "BadRequestError") -> dict:
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}


def sampling_params(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], int]:
    """sglite sampling parameters and ``n`` from an OpenAI body."""
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in SAMPLING_KEYS:
            if key in ("max_tokens", "max_completion_tokens") and value is not None and (
                    type(value) is not int or value < 1):  # (SGLang's; /generate takes 0)
                raise OpenAIError(f"{key} must be a positive integer, got {_json_short(value)}", key)
            if key == "min_tokens" and value is not None and (type(value) is not int or value < 0):
                raise OpenAIError(f"min_tokens must be a non-negative integer, got {_json_short(value)}", key)
            if value is not None:
                params[SAMPLING_KEYS[key]] = value
        elif key in UNSUPPORTED:
            if value not in UNSUPPORTED[key]:
                raise OpenAIError(f"{key} is not supported by sglite", key)
        elif key not in IGNORED_KEYS and key not in (CHAT_KEYS if chat else COMPLETION_KEYS):
            raise OpenAIError(f"unknown parameter {key!r}", key)
    params.update(response_format_params(body.get("response_format")))
    if "max_new_tokens" not in params:
        # completions: OpenAI's 16; a chat without a limit runs to a stop or to the end of
        # the context (as SGLang's: the scheduler caps the output at what the prompt leaves)
        params["max_new_tokens"] = NO_LIMIT if chat else DEFAULT_MAX_TOKENS
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise OpenAIError(f"n must be an integer from 1 to {MAX_N}, got {n!r}", "n")
    return params, n


def response_format_params(fmt: Any) -> dict[str, str]:
    """OpenAI's response_format as SGLang turns it into sampling parameters: text -> none,
    json_object -> the schema {"type": "object"}, json_schema -> its schema,
    structural_tag -> the whole object (xgrammar's structural tag)."""
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema", "structural_tag"):
        raise OpenAIError("response_format must be an object whose type is text, json_object, json_schema or "
                          f"structural_tag, got {_json_short(fmt)}", "response_format")
    kind = fmt["type"]
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise OpenAIError("schema_ is required for json_schema response format request.", "response_format")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(fmt)}
    return {}


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage): JSON booleans or null, nothing else."""
    stream = _bool(body.get("stream"), "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise OpenAIError(f"stream_options must be an object, got {_json_short(options)}", "stream_options")
    return stream, _bool((options or {}).get("include_usage"), "stream_options.include_usage")


def extra_key_of(body: dict[str, Any]) -> str | None:
    """The request's cache key: vLLM's ``cache_salt``, SGLang's ``extra_key``, or both
    joined (SGLang's ``_compute_extra_key``); requests share cached prefixes only with
    requests of the same key. The gate checks what it is."""
    parts = [body.get(k) for k in ("cache_salt", "extra_key") if body.get(k) is not None]
    if len(parts) == 2 and all(isinstance(p, str) for p in parts):
        return parts[0] + parts[1]
    return parts[0] if parts else None


def logprob_params(body: dict[str, Any], chat: bool) -> LogprobParams:
    """SGLang's mapping: chat ``logprobs: bool`` with ``top_logprobs: k`` (ignored
    without logprobs, as SGLang does); completions ``logprobs: k`` (null: none), with
    ``echo`` and k > 0 also the prompt's logprobs. The gate checks k's range."""
    if chat:
        wanted = _bool(body.get("logprobs"), "logprobs")
        k = _top_count(body, "top_logprobs") if wanted else 0
        return LogprobParams(wanted, -1, k, None, True)
    k = _top_count(body, "logprobs")
    return LogprobParams(body.get("logprobs") is not None, 0 if echo_of(body) and k else -1, k, None, True)


def _top_count(body: dict[str, Any], name: str) -> int:
    """A count of top tokens: null (0) or an integer in [0, MAX_TOP_LOGPROBS]."""
    k = body.get(name)
    if k is None:
        return 0
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise OpenAIError(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS} (the number of top tokens) or "
                          f"null, got {_json_short(k)}", name)
    return k


def continue_final_message(body: dict[str, Any]) -> bool:
    """SGLang's chat flag: a last assistant message is continued, not answered."""
    return _bool(body.get("continue_final_message"), "continue_final_message")


def echo_of(body: dict[str, Any]) -> bool:
    return _bool(body.get("echo"), "echo")


def chat_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` from SGLang's meta_info entries, output tokens from
    ``start`` on (a stream's new ones); None when none were asked for."""
    if "output_token_logprobs" not in meta:
        return None
    tops = meta.get("output_top_logprobs") or []
    content = []
    for j, (value, _, text) in enumerate(meta["output_token_logprobs"][start:], start):
        top = tops[j] if j < len(tops) and tops[j] else []
        content.append({"token": text, "bytes": list(text.encode()), "logprob": value,
                        "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": v} for v, _, t in top]})
    return {"content": content}


def completion_logprobs(meta: dict[str, Any], echo: bool, start: int = 0) -> dict[str, Any] | None:
    """A completion choice's ``logprobs`` (OpenAI's legacy shape): with ``echo``, the
    prompt's entries first (the first has no logprob: null); output tokens from
    ``start`` on. ``text_offset`` is -1, as SGLang's."""
    if "output_token_logprobs" not in meta:
        return None
    entries = meta["output_token_logprobs"][start:]
    tops = (meta.get("output_top_logprobs") or [])[start:] if "output_top_logprobs" in meta else None
    if echo:
        entries = meta.get("input_token_logprobs", []) + entries
        tops = None if tops is None else meta.get("input_top_logprobs", []) + tops
    return {"text_offset": [-1] * len(entries), "token_logprobs": [v for v, _, _ in entries],
            "tokens": [t for _, _, t in entries],
            "top_logprobs": [] if tops is None else [None if pos is None else _top_dict(pos) for pos in tops]}


def _top_dict(entries: list[Any]) -> dict[str, float]:
    """token text -> logprob, best first; of two tokens with one text the better (SGLang's)."""
    out: dict[str, float] = {}
    for value, _, text in entries:
        out.setdefault(text, value)
    return out


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be true or false, got {_json_short(value)}", name)
    return value


def _json_short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def stream_error(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The error event a stream ends with, if its request failed (a failed round) or was
    aborted with an HTTP status (SGLang: 503, typed SERVICE_UNAVAILABLE, for the timeouts)."""
    reason = meta.get("finish_reason") or {}
    if reason.get("status_code"):
        code = int(reason["status_code"])
        kind = {503: "SERVICE_UNAVAILABLE", 400: "BAD_REQUEST"}.get(code, str(code))
        return error_body(reason.get("message", ""), code=code, kind=kind)
    return error_body(meta["error"]) if "error" in meta else None


def matched_stop(meta: dict[str, Any]) -> str | int | None:
    """What stopped it: the stop string, or the stop token id (EOS too); None after a
    length or abort finish, as SGLang's."""
    reason = meta.get("finish_reason") or {}
    return reason.get("matched") if reason.get("type") == "stop" else None


def finish_reason(meta: dict[str, Any]) -> str | None:
    """sglite's finish reason as OpenAI names it."""
    kind = (meta.get("finish_reason") or {}).get("type")
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(kind, kind)


def usage(metas: list[dict[str, Any]], n: int = 1) -> dict[str, int]:
    """Token counts of a request's choices (each prompt's ``n`` in a row): every prompt
    once, summed, as SGLang counts them (OpenAI counts a prompt once for n)."""
    prompt = sum(m.get("prompt_tokens", 0) for m in metas[::n])
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": metas[0].get("cached_tokens", 0) if metas else 0}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(rid: str, model: str, texts: list[str], metas: list[dict[str, Any]], n: int = 1,
                        echo: bool = False) -> dict[str, Any]:
    """``texts``: each choice's text (with ``echo``, after its prompt's)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": t, "logprobs": completion_logprobs(m, echo),
                         "finish_reason": finish_reason(m), "matched_stop": matched_stop(m)}
                        for i, (t, m) in enumerate(zip(texts, metas))],
            "usage": usage(metas, n)}


def chat_response(rid: str, model: str, texts: list[str], metas: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": t, "reasoning_content": None,
                                                 "tool_calls": None},
                         "logprobs": chat_logprobs(m), "finish_reason": finish_reason(m),
                         "matched_stop": matched_stop(m)}
                        for i, (t, m) in enumerate(zip(texts, metas))],
            "usage": usage(metas, n)}


def stream_chunk(rid: str, model: str, chat: bool, index: int, text: str | None, reason: str | None,
                 first: bool = False, logprobs: dict[str, Any] | None = None, stop: str | int | None = None
                 ) -> dict[str, Any]:
    """One server-sent event of a streamed completion or chat (``logprobs``: those of
    its new tokens; ``stop``: matched_stop, at the finish). A chat delta always has
    ``reasoning_content`` (null: sglite has no reasoning parser), as SGLang's."""
    if chat:
        delta: dict[str, Any] = {"reasoning_content": None}
        if first:
            delta.update(role="assistant", content="")
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                                  "matched_stop": stop}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason,
                  "matched_stop": stop}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}


def prompts_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """/v1/completions' ``prompt``, in OpenAI's four forms: a string, a list of token
    ids, a list of strings, or a list of token-id lists. Decided by the first item; the
    gate checks each id (off the event loop when there are many)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt:
        if _is_int(prompt[0]):
            return [{"input_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [{"input_ids": p} for p in prompt]
    raise OpenAIError("prompt must be a string, a list of token ids, or a non-empty list of strings or of token-id "
                      "lists", "prompt")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SCORE_KEYS = {"model", "query", "items", "label_token_ids", "apply_softmax", "item_first"}


def score_inputs(body: dict[str, Any], vocab_size: int) -> tuple[list[dict[str, Any]], list[int], bool]:
    """SGLang's /v1/score body: one prompt per item (query then item, or item first with
    ``item_first``: strings joined as they are, token ids one after the other), the
    label token ids, and ``apply_softmax``."""
    unknown = set(body) - SCORE_KEYS
    if unknown:
        raise OpenAIError(f"unknown parameter {sorted(unknown)[0]!r}", sorted(unknown)[0])
    labels, items, query = body.get("label_token_ids"), body.get("items"), body.get("query")
    if not labels:
        raise OpenAIError("label_token_ids must be provided", "label_token_ids")
    if items is None:
        raise OpenAIError("items must be provided", "items")
    if not isinstance(labels, list) or not all(_is_int(t) for t in labels) or len(labels) > MAX_TOP_LOGPROBS * 3:
        raise OpenAIError(f"label_token_ids must be a list of at most {MAX_TOP_LOGPROBS * 3} token ids",
                          "label_token_ids")
    bad = next((t for t in labels if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise OpenAIError(f"Token ID {bad} is out of vocabulary (vocab size: {vocab_size})", "label_token_ids")
    items = [items] if isinstance(items, str) else items
    first = _bool(body.get("item_first"), "item_first")
    if isinstance(query, str) and isinstance(items, list) and all(isinstance(i, str) for i in items):
        prompts = [{"prompt": i + query if first else query + i} for i in items]
    elif _is_ids(query) and isinstance(items, list) and all(_is_ids(i) for i in items):
        prompts = [{"input_ids": i + query if first else query + i} for i in items]
    else:
        raise OpenAIError("Invalid combination of query/items types for score_request.", "items")
    return prompts, labels, _bool(body.get("apply_softmax"), "apply_softmax")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def scores(metas: list[dict[str, Any]], labels: list[int], apply_softmax: bool) -> list[list[float]]:
    """Per item, its label tokens' probabilities as the next token after its prompt, in
    label order: exp(logprob), or with ``apply_softmax`` renormalized over the labels."""
    out = []
    for meta in metas:
        by_id = {t: v for v, t, _ in meta["output_token_ids_logprobs"][0]}
        values = [by_id[t] for t in labels]
        if apply_softmax:
            top = max(values)
            weights = [math.exp(v - top) for v in values]
            out.append([w / sum(weights) for w in weights])
        else:
            out.append([math.exp(v) for v in values])
    return out
