"""Request and output structures between the Engine and the Scheduler
(SGLang: managers/io_struct.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglite.sampling.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    """What a user submits: text, chat messages or token ids, plus sampling params."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    sampling_params: dict[str, Any] | None = None
    rid: str | None = None
    stream: bool = False


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    error: str | None = None  # set when the request was rejected before tokenizing


@dataclass
class AbortReq:
    rid: str
    message: str = "aborted by user"


@dataclass
class BatchStrOut:
    """One request's progress this round (SGLang batches these; one per request here)."""

    rid: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    meta_info: dict[str, Any] = field(default_factory=dict)
