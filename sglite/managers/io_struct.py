"""The messages between the Engine (SGLang's TokenizerManager), the Scheduler and the
DetokenizerManager (SGLang: managers/io_struct.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglite.sampling.sampling_params import SamplingParams

# rids of the server's health probes (SGLang's prefix): a busy scheduler answers one at
# once instead of running it, since producing tokens already shows it is alive
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"


# at most this many top tokens a position, and tokens asked about (SGLang has no bound;
# OpenAI's chat API allows 20 top tokens): the answer grows with both times the positions
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 64


@dataclass
class LogprobParams:
    """SGLang's logprob fields of a generate request (GenerateReqInput): whether to
    return logprobs, from which prompt position (-1: only the output's), how many top
    tokens a position, the logprobs of which given tokens, and each token's text."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False

    def check(self, vocab_size: int) -> None:
        """ValueError naming the field for a value of the wrong type or range."""
        for name in ("return_logprob", "return_text_in_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}"[:200])
        start, k = self.logprob_start_len, self.top_logprobs_num
        for name, value in (("logprob_start_len", start), ("top_logprobs_num", k)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}"[:200])
        if start < -1:
            raise ValueError(f"logprob_start_len must be -1 (output logprobs only) or a prompt position, got {start}")
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
        ids = self.token_ids_logprob
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"token_ids_logprob must be a list of token ids, got {ids!r}"[:200])
            if len(ids) > MAX_TOKEN_IDS_LOGPROB:
                raise ValueError(f"token_ids_logprob has {len(ids)} ids; at most {MAX_TOKEN_IDS_LOGPROB}")
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"token_ids_logprob has {bad}, outside the vocabulary (0..{vocab_size - 1})")

    def start_for(self, input_len: int) -> int:
        """The first prompt position with an entry (SGLang's rule: -1 is the last prompt
        token, so only the output's logprobs); ValueError past the prompt."""
        if self.logprob_start_len == -1:
            return input_len - 1
        if self.logprob_start_len >= input_len:
            raise ValueError(f"logprob_start_len={self.logprob_start_len} is higher than the number of input tokens "
                             f"({input_len}). Please use a smaller logprob_start_len.")
        return self.logprob_start_len


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
    logprob: LogprobParams | None = None  # None: no logprobs asked for


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
    # return_logprob: the new tokens' entries (and, the first time, the prompt's), as
    # ReqLogprobs.take gives them; the TokenizerManager makes SGLang's meta_info of them
    logprobs: dict[str, list[Any]] | None = None


@dataclass
class BatchStrOut:
    """DetokenizerManager -> Engine: one request's new text and tokens (SGLang's
    ``BatchStrOutput``, one per request here)."""

    rid: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    meta_info: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] | None = None  # BatchTokenIDOut's, passed on


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
