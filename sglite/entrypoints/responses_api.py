"""OpenAI's Responses API for plain text (SGLang: entrypoints/openai/serving_responses.py):
``POST /v1/responses`` with ``input`` (a string, or messages whose content is text) and
``instructions``, answered as a ``response`` object, or streamed as SGLang's sequence of
``response.*`` events. No tools, no reasoning items, nothing stored: a response cannot be
fetched or continued later (``previous_response_id`` and ``store: true`` beyond this
answer are not offered), and anything else OpenAI defines is a 400 naming it."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from sglite.entrypoints.openai_api import OpenAIError, _bool, _json_short, finish_reason

# Responses parameter -> sglite sampling parameter
SAMPLING_KEYS = {"max_output_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p"}
# accepted: "store" only as false or absent-and-unstored (sglite keeps nothing), "metadata" echoed
ACCEPTED_KEYS = {"model", "input", "instructions", "stream", "store", "metadata", "user", "truncation",
                 "parallel_tool_calls", "tool_choice", "tools"}
DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


def parse(body: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any], bool]:
    """(chat messages, sampling parameters, stream) from a Responses body."""
    unknown = set(body) - ACCEPTED_KEYS - set(SAMPLING_KEYS)
    if unknown:
        name = sorted(unknown)[0]
        raise OpenAIError(f"{name} is not supported by sglite's /v1/responses", name)
    if body.get("tools") or body.get("tool_choice") not in (None, "none", "auto"):
        raise OpenAIError("tools are not supported by sglite", "tools")
    if body.get("store"):
        raise OpenAIError("store: sglite keeps no responses (send store: false)", "store")
    messages = _messages(body.get("input"), body.get("instructions"))
    params = {SAMPLING_KEYS[k]: v for k, v in body.items() if k in SAMPLING_KEYS and v is not None}
    return messages, params, _bool(body.get("stream"), "stream")


def _messages(given: Any, instructions: Any) -> list[dict[str, str]]:
    """``input`` as chat messages: a string is one user message; a list holds
    {"role", "content"} items whose content is a string or a list of text parts."""
    if instructions is not None and not isinstance(instructions, str):
        raise OpenAIError(f"instructions must be a string, got {_json_short(instructions)}", "instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return head + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise OpenAIError("input must be a string or a non-empty list of messages", "input")
    out = []
    for item in given:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str) or item.get("type", "message") != "message":
            raise OpenAIError(f"each input item must be a message with a role, got {_json_short(item)}", "input")
        out.append({"role": item["role"], "content": _text(item.get("content"))})
    return head + out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIError(f"a message's content must be text (input_text parts), got {_json_short(content)}", "input")


def new_ids() -> tuple[str, str]:
    """(the response's id, its message's id)."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def response(rid: str, msg_id: str, model: str, body: dict[str, Any], text: str | None,
             meta: dict[str, Any] | None) -> dict[str, Any]:
    """The ``response`` object: in progress (``meta`` None) or as it ended."""
    done = meta is not None
    incomplete = done and finish_reason(meta) == "length"
    status = "in_progress" if not done else "incomplete" if incomplete else "completed"
    output = [] if text is None else [message(msg_id, text, "incomplete" if incomplete else "completed")]
    usage = None
    if done:
        prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
                 "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + completion}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "status": status,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", DEFAULTS["temperature"]),
            "top_p": body.get("top_p", DEFAULTS["top_p"]), "parallel_tool_calls": False, "tool_choice": "none",
            "tools": [], "store": False, "metadata": body.get("metadata") or {}, "text": {"format": {"type": "text"}}}


def message(msg_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "status": status,
            "content": [part(text)]}


def part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class EventStream:
    """SGLang's order of streamed events, each numbered (``sequence_number``):
    response.created, .in_progress, .output_item.added, .content_part.added, then
    .output_text.delta per new text, .output_text.done, .content_part.done,
    .output_item.done, .completed."""

    def __init__(self, rid: str, msg_id: str, model: str, body: dict[str, Any]):
        self.rid, self.msg_id, self.model, self.body, self.seq = rid, msg_id, model, body, 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def opening(self) -> list[bytes]:
        start = response(self.rid, self.msg_id, self.model, self.body, None, None)
        where = {"item_id": self.msg_id, "output_index": 0}
        return [self.event("response.created", response=start), self.event("response.in_progress", response=start),
                self.event("response.output_item.added", output_index=0,
                           item={**message(self.msg_id, "", "in_progress"), "content": []}),
                self.event("response.content_part.added", **where, content_index=0, part=part(""))]

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, text: str, meta: dict[str, Any]) -> list[bytes]:
        final = response(self.rid, self.msg_id, self.model, self.body, text, meta)
        where = {"item_id": self.msg_id, "output_index": 0}
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, content_index=0, part=part(text)),
                self.event("response.output_item.done", output_index=0, item=final["output"][0]),
                self.event(kind, response=final)]
