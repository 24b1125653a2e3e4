"""OpenAI-compatible request parsing and response shapes (SGLang:
entrypoints/openai/serving_completions.py, serving_chat.py, protocol.py).

A request body becomes sglite sampling parameters here; anything OpenAI defines that
sglite does not do (logprobs, echo, best_of, tools) is a 400 naming the parameter,
never silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

# OpenAI parameter -> sglite sampling parameter
SAMPLING_KEYS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                 "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "stop": "stop", "seed": "seed", "frequency_penalty": "frequency_penalty",
                 "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
                 "stop_token_ids": "stop_token_ids"}
IGNORED_KEYS = {"model", "stream", "stream_options", "n", "user", "prompt", "messages", "logit_bias",
                "response_format", "parallel_tool_calls", "service_tier", "store", "metadata",
                "cache_salt", "extra_key"}  # (the last two: extra_key_of)
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
               "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none")}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
NO_LIMIT = 1 << 30  # a chat's max_new_tokens when none is given (the scheduler caps it at max_req_len)
MAX_N = 16
MAX_BATCH = 1024  # requests one body may make: a /generate batch, or prompts x n here


class OpenAIError(ValueError):
    """A bad request: 400 with OpenAI's error body naming ``param``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None = None, code: int = 400, kind: str = "BadRequestError") -> dict:
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}


def sampling_params(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], int]:
    """sglite sampling parameters and ``n`` from an OpenAI body."""
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in SAMPLING_KEYS:
            if value is not None:
                params[SAMPLING_KEYS[key]] = value
        elif key in UNSUPPORTED:
            if value not in UNSUPPORTED[key]:
                raise OpenAIError(f"{key} is not supported by sglite", key)
        elif key not in IGNORED_KEYS:
            raise OpenAIError(f"unknown parameter {key!r}", key)
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


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be true or false, got {_json_short(value)}", name)
    return value


def _json_short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def finish_reason(meta: dict[str, Any]) -> str | None:
    """sglite's finish reason as OpenAI names it."""
    kind = (meta.get("finish_reason") or {}).get("type")
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(kind, kind)


def usage(metas: list[dict[str, Any]]) -> dict[str, int]:
    """Token counts of a request's choices: the prompt once (OpenAI counts it once for n)."""
    prompt = metas[0].get("prompt_tokens", 0) if metas else 0
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": metas[0].get("cached_tokens", 0) if metas else 0}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(rid: str, model: str, texts: list[str], metas: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": finish_reason(m)}
                        for i, (t, m) in enumerate(zip(texts, metas))],
            "usage": usage(metas)}


def chat_response(rid: str, model: str, texts: list[str], metas: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                         "finish_reason": finish_reason(m)} for i, (t, m) in enumerate(zip(texts, metas))],
            "usage": usage(metas)}


def stream_chunk(rid: str, model: str, chat: bool, index: int, text: str | None,
                 reason: str | None, first: bool = False) -> dict[str, Any]:
    """One server-sent event of a streamed completion or chat."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
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
