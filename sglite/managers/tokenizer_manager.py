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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from sglite.managers.io_struct import TokenizedGenerateReqInput
from sglite.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglite.model_loader.tokenizer import Tokenizer


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
            prompt = self._need_tokenizer().apply_chat_template(_check_messages(messages), add_generation_prompt=True)
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
