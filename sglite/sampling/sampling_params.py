"""Per-request sampling parameters, SGLang's keys and defaults
(SGLang: sampling/sampling_params.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

_GREEDY_EPS = 1e-6
# Bounds on what one request may ask the scheduler to check every step (docs/serving.md,
# "Limits"): each stop string is searched for in the output's tail after every token,
# and a request's parameters are kept while it runs.
MAX_STOP_STRS = 64
MAX_STOP_STR_LEN = 512  # characters
MAX_STOP_TOKEN_IDS = 4096
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_GRAMMAR_CHARS = 65536  # a json_schema, regex, ebnf or structural_tag (compiled in the background)
# the parameters that constrain the output to a grammar (at most one per request)
GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")
# a nonzero float parameter below this is refused: float32 arithmetic would round it to
# 0 (top_p 0 keeps no token) or overflow dividing by it (repetition_penalty)
MIN_NONZERO = 1e-30
# max_new_tokens of a request that set no limit (a chat without max_tokens): it runs to
# a stop or to what the context leaves (the scheduler caps it); not an explicit request
UNLIMITED_NEW_TOKENS = 1 << 30
# SGLang's TOP_K_ALL: top_k = -1 (off) becomes "keep every token"
TOP_K_ALL = 1 << 30


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # until then the EOS and stop tokens are masked out
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # sglite: a per-request seed makes sampling reproducible whatever the batch holds
    seed: int | None = None
    n: int = 1  # SGLang's parallel samples: /generate and OpenAI's n make n requests of n = 1
    logit_bias: dict[str, float] | None = None  # token id (a string, as in JSON) -> added to its logit
    # constrained output (docs/structured_output.md): a JSON schema (a JSON string, or an
    # object here), a regular expression, an EBNF grammar, or an xgrammar structural tag
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_strs: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Raises ValueError naming the field for an unknown key or a value of the wrong
        type (ranges are ``verify``'s, which needs the vocabulary size)."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"stop_strs"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(map(str, unknown)))}")
        d = {k: (json.dumps(v) if k in ("json_schema", "structural_tag") and isinstance(v, (dict, bool)) else v)
             for k, v in d.items()}  # a schema may come as JSON text or as the object itself
        params = cls(**d)
        params.check_types()
        return params

    def to_dict(self) -> dict[str, Any]:
        """The parameters from_dict takes (not the derived stop_strs)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stop_strs"}

    def check_types(self) -> None:
        """Every field has its type: ints are ints (not bools or floats), floats are
        finite numbers, flags are bools, stop is a str or a list of non-empty strs."""
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            _need_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            _need_finite(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {short_repr(getattr(self, name))}")
        if self.seed is not None:
            _need_int("seed", self.seed)
            if not 0 <= self.seed < 1 << 64:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        self._check_stops()
        self._check_logit_bias()
        self._check_grammar()

    def _check_grammar(self) -> None:
        """json_schema, regex, ebnf, structural_tag: strings of at most MAX_GRAMMAR_CHARS;
        at most one of them (SGLang's rule). Whether one parses is the gate's check
        (sglite.constrained.xgrammar_backend.build_grammar)."""
        for name in GRAMMAR_PARAMS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {short_repr(value)}")
            check_utf8(name, value)
            if len(value) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{name} has {len(value)} characters; at most {MAX_GRAMMAR_CHARS}")
        if sum(getattr(self, name) is not None for name in GRAMMAR_PARAMS) > 1:
            raise ValueError("Only one of regex, json_schema, ebnf or structural_tag can be set.")

    def _check_logit_bias(self) -> None:
        """logit_bias: at most MAX_LOGIT_BIAS entries, each a token id (an integer, or a
        string of one, as JSON keys are) -> a finite number in [-100, 100] (OpenAI's range)."""
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be an object of token id -> bias, got {short_repr(bias)}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} tokens; at most {MAX_LOGIT_BIAS}")
        for key, value in bias.items():
            if not (_is_int(key) or (isinstance(key, str) and key.lstrip("-").isdigit())):
                raise ValueError(f"logit_bias keys must be token ids, got {short_repr(key)}")
            _need_finite(f"logit_bias[{key}]", value)
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100], got {value}")

    def _check_stops(self) -> None:
        """stop: a string or a list of at most MAX_STOP_STRS non-empty UTF-8 strings of at
        most MAX_STOP_STR_LEN characters; stop_token_ids: at most MAX_STOP_TOKEN_IDS ints."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {short_repr(self.stop)}")
        if stops is not None and len(stops) > MAX_STOP_STRS:
            raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRS}")
        for x in stops or ():
            check_utf8("stop", x)
            if len(x) > MAX_STOP_STR_LEN:
                raise ValueError(f"a stop string has {len(x)} characters; at most {MAX_STOP_STR_LEN}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) for t in ids)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {short_repr(ids)}")
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}")

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a one-line reason for a request that cannot run
        (``vocab_size`` None: all but the stop_token_ids' range, for a check before a
        model is loaded)."""
        self.check_types()
        if self.n != 1:
            raise ValueError(f"n must be 1 here (several samples of one prompt: n from 1 to 16 on /generate and the "
                             f"OpenAI routes; in Engine.generate the prompt n times), got {self.n}")
        if self.max_new_tokens < 0:  # 0: SGLang's scoring request (the prompt's logprobs, no output)
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                             f"got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value != 0 and abs(value) < MIN_NONZERO:
                raise ValueError(f"{name} {value!r} is too small: a nonzero value must be at least {MIN_NONZERO:g} "
                                 "(float32 would round it to 0)")
        for t in (self.stop_token_ids or []) if vocab_size is not None else []:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids has {t}, outside the vocabulary (0..{vocab_size - 1})")
        for t in map(int, self.logit_bias or {}) if vocab_size is not None else []:
            if not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias has token {t}, outside the vocabulary (0..{vocab_size - 1})")

    def normalize(self) -> None:
        """Temperature 0 means greedy, as in SGLang: keep only the top token."""
        if self.temperature < _GREEDY_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1 or self.top_k > TOP_K_ALL:
            self.top_k = TOP_K_ALL  # more than the vocabulary is all of it
        stop = self.stop
        self.stop_strs = [stop] if isinstance(stop, str) else list(stop or [])

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1

    @property
    def bias_ids(self) -> dict[int, float]:
        """logit_bias with int keys."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @property
    def has_grammar(self) -> bool:
        return any(getattr(self, name) is not None for name in GRAMMAR_PARAMS)

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def check_utf8(name: str, text: str) -> None:
    """``text`` encodes as UTF-8: JSON's ``\\ud800`` escapes and Python strings may hold lone
    surrogates, which no tokenizer, socket or response can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid UTF-8 text: it holds {text[e.start]!r} at character {e.start} "
                         "(a lone surrogate)") from None


def short_repr(value: Any, limit: int = 80) -> str:
    """repr of a value for an error line, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need_int(name: str, v: Any) -> None:
    if not _is_int(v):
        raise ValueError(f"{name} must be an integer, got {short_repr(v)}")


def _need_finite(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {short_repr(v)}")
