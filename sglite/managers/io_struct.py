"""The messages between the Engine (SGLang's TokenizerManager), the Scheduler and the
DetokenizerManager (SGLang: managers/io_struct.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglite.sampling.sampling_params import SamplingParams

# rids of the server's health probes (SGLang's prefix): a busy scheduler answers one at
# once instead of running it, since producing tokens already shows it is alive
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    error: str | None = None  # set when the request was rejected before tokenizing
    trace_parent: str = ""  # W3C traceparent of the HTTP request's span: its trace continues here
    # SGLang's extra_key (OpenAI's cache_salt): requests share cached prefixes only with
    # requests of the same key (None: the unsalted tree every plain request shares)
    extra_key: str | None = None


@dataclass
class AbortReq:
    rid: str
    message: str = "aborted by user"


@dataclass
class BatchTokenIDOut:
    """Scheduler -> DetokenizerManager: one request's tokens produced since its last
    output (SGLang's ``BatchTokenIDOutput`` carries a round's requests in lists; sglite
    sends one per request), with what the detokenizer needs to turn them into text."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    meta_info: dict[str, Any] = field(default_factory=dict)
    skip_special_tokens: bool = True
    stop_strs: tuple[str, ...] = ()  # text that could start one is held back while streaming
    matched_stop_str: str | None = None  # the request finished on it: cut it from the text


@dataclass
class BatchStrOut:
    """DetokenizerManager -> Engine: one request's new text and tokens (SGLang's
    ``BatchStrOutput``, one per request here)."""

    rid: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlushCacheReqInput:
    """Empty the radix cache (``/flush_cache``); refused while requests run."""


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetInternalStateReq:
    """The scheduler's state now (``/get_server_info``)."""


@dataclass
class GetInternalStateReqOutput:
    internal_state: dict[str, Any]


@dataclass
class ExplainReq:
    """A request's history in words (``/explain?rid=``; Engine.explain offline)."""

    rid: str


@dataclass
class ExplainReqOutput:
    text: str  # "" when the scheduler's history has no such rid
    error: str = ""


@dataclass
class DebugControlReq:
    """Pause, run or step the server's scheduler (``sglite serve --enable-debug-control``,
    for ``sglite tui --attach``): "pause", "run", "step" (one iteration, pausing) or
    "status"."""

    cmd: str


@dataclass
class DebugControlReqOutput:
    paused: bool
    iteration: int
