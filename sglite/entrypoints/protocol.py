"""The request bodies of `sglite serve`, as pydantic models (SGLang:
entrypoints/openai/protocol.py for the OpenAI routes, managers/io_struct.py's
GenerateReqInput for /generate). They describe the bodies in /openapi.json, so a client
generator or a fuzzer (schemathesis, tests/entrypoints/test_schema_fuzz.py) knows what
each route takes. The routes parse bodies themselves (http_server.py, openai_api.py:
one-line errors naming the field, SGLang's status codes); tests check that these
models and those parsers accept the same fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

Stop = str | list[str] | None
Ids = list[int]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it


class SamplingParamsInput(_Strict):
    """/generate's ``sampling_params`` (sampling/sampling_params.py: SGLang's keys; its
    verify() has every range, sglite's limits on stops are docs/serving.md's)."""

    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=16)  # /generate: n requests of one sample each
    logit_bias: dict[str, float] | None = None
    # constrained output, at most one (docs/structured_output.md)
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class GenerateReqInput(_Strict):
    """POST /generate: one request, or a batch (a list of texts or of token-id lists);
    the logprob fields one for all or a list of one each (docs/serving.md, "Logprobs")."""

    text: str | list[str] | None = None
    input_ids: Ids | list[Ids] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    rid: str | list[str] | None = None
    stream: bool | None = False
    extra_key: str | None = None  # the cache key (docs/serving.md, "Cache isolation")
    cache_salt: str | None = None
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = Field(None, ge=-1)
    top_logprobs_num: int | list[int] | None = Field(None, ge=0, le=20)
    token_ids_logprob: Ids | list[Ids] | None = None
    return_text_in_logprobs: bool | None = False


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = False


class ResponseFormat(BaseModel):
    """OpenAI's response_format; structural_tag is SGLang's (xgrammar's structural tag:
    its ``structures`` and ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class _OpenAISampling(_Strict):
    """What completions and chat share (openai_api.py's SAMPLING_KEYS, IGNORED_KEYS and
    UNSUPPORTED: the last must keep their off values)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    stop: Stop = None
    seed: int | None = Field(None, ge=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(1, ge=1, le=16)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang's extensions: a grammar for the output
    ebnf: str | None = None
    json_schema: str | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    best_of: Literal[1] | None = None
    suffix: Literal[""] | None = None
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none"] | None = None
    functions: list[Any] | None = Field(None, max_length=0)
    function_call: Literal["none"] | None = None


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions."""

    prompt: str | Ids | list[str] | list[Ids]
    logprobs: int | None = Field(None, ge=0, le=20)  # top tokens per position
    echo: bool | None = False


class ChatCompletionMessage(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: list[ChatCompletionMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    continue_final_message: bool | None = False


class AbortReqInput(_Strict):
    """POST /abort_request: one request's rid, or every request."""

    rid: str | None = None
    abort_all: bool | None = False


class ResponseInputMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]]
    type: Literal["message"] | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses (plain text: no tools, nothing stored)."""

    model: str | None = None
    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto"] | None = None
    tools: list[Any] | None = Field(None, max_length=0)


class ScoringRequest(_Strict):
    """POST /v1/score: the probability of each label token right after query + item."""

    model: str | None = None
    query: str | Ids
    items: str | list[str] | list[Ids]
    label_token_ids: Ids = Field(min_length=1, max_length=60)
    apply_softmax: bool | None = False
    item_first: bool | None = False


class TokenizeRequest(_Strict):
    """POST /tokenize (and /v1/tokenize)."""

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool | None = True


class DetokenizeRequest(_Strict):
    """POST /detokenize (and /v1/detokenize)."""

    model: str | None = None
    tokens: Ids | list[Ids]
    skip_special_tokens: bool | None = True


class DebugControlInput(_Strict):
    """POST /debug/control (--enable-debug-control)."""

    cmd: Literal["pause", "run", "step", "status"]


BODIES: tuple[type[BaseModel], ...] = (GenerateReqInput, CompletionRequest, ChatCompletionRequest, AbortReqInput,
                                       ResponsesRequest, ScoringRequest, TokenizeRequest, DetokenizeRequest,
                                       DebugControlInput)
REF = "#/components/schemas/{model}"


def body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is ``model``."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def component_schemas() -> dict[str, Any]:
    """Every body model's JSON schema (and the models they hold), for /openapi.json."""
    _, top = models_json_schema([(m, "validation") for m in BODIES], ref_template=REF)
    return top.get("$defs", {})
