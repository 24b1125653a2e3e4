"""ModelRunner: loads the model, owns the KV pools and the attention backend, runs
one forward and samples (SGLang: model_executor/model_runner.py)."""

from __future__ import annotations

import logging
import os
import time

import torch

from sglite.configs.model_config import ModelConfig
from sglite.distributed.parallel_state import (GroupCoordinator, TpRankDiedError, destroy_model_parallel,
                                               get_tp_group, init_distributed_environment)
from sglite.distributed.utils import head_shard
from sglite.layers.attention.base_attn_backend import AttentionBackend
from sglite.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglite.layers.custom_op import set_custom_op_impl
from sglite.layers.rotary_embedding import RotaryEmbedding
from sglite.layers.sampler import Sampler
from sglite.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator, page_align_down
from sglite.model_executor.forward_batch_info import ForwardBatch, ForwardBatchBroadcast
from sglite.models.llama import LlamaForCausalLM
from sglite.server_args import ServerArgs, resolve_device

logger = logging.getLogger("sglite")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the KV pool's share of the memory left after the weights (--mem-fraction-static);
# SGLang's GPU default is about 0.88; on a CPU the pool shares RAM with everything else
DEFAULT_MEM_FRACTION_CUDA = 0.88
DEFAULT_MEM_FRACTION_CPU = 0.1
FALLBACK_AVAILABLE_MEMORY = 8 << 30  # bytes, when /proc/meminfo cannot be read
# SGLang sizes max_running_requests from GPU memory; on a CPU a few hundred is plenty
DEFAULT_MAX_RUNNING_REQUESTS_CAP = 256
REQ_TO_TOKEN_EXTRA_COLUMNS = 4  # req_to_token rows are a little longer than the context


# what --dtype auto means on a CPU, when set (float32 or bfloat16); the test suite sets
# float32 so that its exact expected outputs hold on every CPU
CPU_DTYPE_ENV = "SGLITE_CPU_DTYPE"
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the cpu backend's kernels take


def cpu_bf16_flags() -> list[str]:
    """The CPU's bfloat16 instructions that /proc/cpuinfo lists (avx512_bf16, amx_bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """auto: bfloat16 on CUDA; on a CPU, bfloat16 where it has bfloat16 dot products
    (AVX512-BF16 or AMX), else float32 ($SGLITE_CPU_DTYPE overrides the CPU's choice)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16
    forced = os.environ.get(CPU_DTYPE_ENV)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_DTYPE_ENV} must be float32 or bfloat16, not {forced!r}")
        return _DTYPES[forced]
    return torch.bfloat16 if cpu_bf16_flags() else torch.float32


def describe_cpu_dtype(dtype: str, resolved: torch.dtype) -> str:
    """One line for the log: which dtype a CPU engine runs and why."""
    name = str(resolved).removeprefix("torch.")
    if dtype != "auto":
        return f"dtype {name} (--dtype {dtype})"
    if os.environ.get(CPU_DTYPE_ENV):
        return f"dtype {name} (--dtype auto, ${CPU_DTYPE_ENV}={os.environ[CPU_DTYPE_ENV]})"
    flags = cpu_bf16_flags()
    if flags:
        return f"dtype {name} (--dtype auto: this CPU has {' and '.join(flags)})"
    return f"dtype {name} (--dtype auto: this CPU has no bfloat16 dot products)"


def resolve_attention_backend(name: str, device: str, dtype: torch.dtype = torch.float32) -> str:
    """auto: triton on CUDA; on a CPU, cpu when the pools are float32 or bfloat16 and its
    C++ kernels build, else torch_native (saying why). Building them is what checks cpu,
    so this runs after the weights load; ModelRunner checks triton before (triton_utils)."""
    if name == "auto":
        if device.startswith("cuda"):
            return "triton"
        if dtype not in CPU_KERNEL_DTYPES:
            return "torch_native"
        why = _cpu_ops_unavailable()
        if why:
            logger.warning("attention backend torch_native (decode rows gather their K/V each layer): %s", why)
            return "torch_native"
        return "cpu"
    if name == "cpu":
        if device.startswith("cuda"):
            raise ValueError("--attention-backend cpu runs on a CPU; use triton or torch_native on CUDA")
        if dtype not in CPU_KERNEL_DTYPES:
            raise ValueError(f"--attention-backend cpu needs float32 or bfloat16 KV pools, not {dtype}")
        why = _cpu_ops_unavailable()
        if why:
            raise ValueError(f"--attention-backend cpu: {why}; --attention-backend torch_native needs no compiler")
    return name


def _cpu_ops_unavailable() -> str:
    """Why sglite's C++ CPU kernels cannot run here ('' when they can); builds them the
    first time on a machine."""
    from sglite.layers.cpu_ops import KernelBuildError, load_cpu_ops

    try:
        load_cpu_ops()
    except KernelBuildError as e:
        return str(e)
    return ""


def split_cpu_threads(local_rank: int, ranks_here: int) -> tuple[set[int], int] | None:
    """tp > 1 on a CPU: the ranks of one machine share its cores, so each takes its own
    contiguous share (SGLang binds a rank to a NUMA node's cores): this process is pinned
    to them and runs that many OpenMP threads; without it every rank would start a
    thread per core and they would fight. Returns what to restore (None: left alone,
    because OMP_NUM_THREADS was set or there are fewer cores than ranks)."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // ranks_here
    if os.environ.get("OMP_NUM_THREADS") or per == 0:
        return None
    before = (set(cores), torch.get_num_threads())
    mine = cores[local_rank * per : (local_rank + 1) * per]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    logger.info("tp rank on cores %s (%d OpenMP threads)", ",".join(map(str, mine)), len(mine))
    return before


def restore_cpu_threads(cores: set[int], threads: int) -> None:
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def _available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return FALLBACK_AVAILABLE_MEMORY


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig | None = None,
                 weights: dict[str, torch.Tensor] | None = None, tp_rank: int = 0):
        """Load ``server_args.model_path`` unless ``model_config`` and ``weights`` are
        given. With ``--tp-size N`` this is rank ``tp_rank``'s runner: it joins the group
        first (the layers read their rank) and holds its shard of the model and the KV
        heads of its query heads."""
        self.server_args = server_args
        self.device = resolve_device(server_args.device)
        self.tp_size, self.tp_rank = server_args.tp_size, tp_rank
        self._cpu_threads_before: tuple[set[int], int] | None = None  # tp > 1 on a CPU: to restore
        self.tp_group = self.init_torch_distributed()
        self.last_tp_timings: list[list[float]] = []  # per rank: [forward s, collectives s] of the last forward
        try:
            self._load(model_config, weights)
        except BaseException:
            self.leave_group()  # the other ranks fail as well (or see this one go)
            raise

    def _load(self, model_config: ModelConfig | None, weights: dict[str, torch.Tensor] | None) -> None:
        server_args = self.server_args
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        if self.device == "cpu" and self.tp_rank == 0:
            logger.info(describe_cpu_dtype(server_args.dtype, self.dtype))
        if server_args.attention_backend == "triton":
            from sglite.layers.triton_utils import check_triton_usable

            check_triton_usable(self.device)  # before the weights load: fail fast
        self.tokenizer = None
        if model_config is None or weights is None:
            from sglite.model_loader import load_model

            loaded = load_model(server_args.model_path, dtype=self.dtype)
            model_config, weights, self.tokenizer = loaded.config, loaded.weights, loaded.tokenizer
            if server_args.skip_tokenizer_init:
                self.tokenizer = None  # ids in, ids out
        self.model_config = model_config
        # the KV heads this rank's pool holds (all of them at tp 1)
        self.num_kv_heads = head_shard(model_config.num_attention_heads, model_config.num_key_value_heads,
                                       self.tp_size, self.tp_rank).num_kv_heads
        # after the weights: a bad model path fails before a first run compiles the CPU kernel
        self.attention_backend = resolve_attention_backend(server_args.attention_backend, self.device, self.dtype)
        self.context_len = min(server_args.context_length or model_config.context_len, model_config.context_len)
        self.model = self._build_model(model_config, weights)
        # the fused RMSNorm / SiLU-and-mul / RoPE kernels go with the attention backend's
        set_custom_op_impl(self.model, {"triton": "triton", "cpu": "cpu"}.get(self.attention_backend, "native"))
        self.sampler = Sampler()
        self.init_memory_pool()
        self.attn_backend = self._build_attn_backend()
        self.init_cuda_graphs()
        self.init_cpu_graph()

    def init_torch_distributed(self) -> GroupCoordinator:
        """tp 1: no group. Else join the ranks at --dist-init-addr (gloo on a CPU, NCCL on
        CUDA, each rank its own GPU of this node)."""
        sa = self.server_args
        if self.tp_size == 1:
            return get_tp_group()
        if sa.dist_init_addr is None:
            raise ValueError("--tp-size > 1: the ranks meet at --dist-init-addr, which Engine and sglite serve set "
                             "when they start the ranks; a ModelRunner alone cannot start them")
        if self.device.startswith("cuda"):
            self.device = f"cuda:{self.tp_rank % (self.tp_size // sa.nnodes)}"
            torch.cuda.set_device(self.device)
        else:
            self._cpu_threads_before = split_cpu_threads(self.tp_rank % (self.tp_size // sa.nnodes),
                                                         self.tp_size // sa.nnodes)
        group = init_distributed_environment(self.tp_size, self.tp_rank, f"tcp://{sa.dist_init_addr}", self.device,
                                             one_machine=sa.nnodes == 1)
        logger.info("tensor parallel: rank %d of %d (%s)", self.tp_rank, self.tp_size,
                    "nccl" if self.device.startswith("cuda") else "shared memory" if group.shm else "gloo")
        return group

    def _build_model(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = model.to_empty(device=self.device).to(self.dtype)
        # built on "meta" to skip random init; the RoPE table is a buffer, so compute it here
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.cos_sin_cache = module._compute_cos_sin_cache().to(self.device)
        model.load_weights((k, v.to(self.device, self.dtype)) for k, v in weights.items())
        model.eval()
        if self._packs_linears():
            # the C++ linears (layers/linear.py): fast in bfloat16, and in either dtype each
            # output sums its products in one order whatever the batch (torch's float32
            # F.linear does not: docs/kernels.md, "Batch invariance")
            model.pack_linear_weights()
        return model

    def _packs_linears(self) -> bool:
        """The cpu backend always; triton on a CPU (the interpreter) when deterministic,
        so that its batch invariance holds end to end there too."""
        if self.device != "cpu" or self.dtype not in (torch.bfloat16, torch.float32):
            return False
        if self.attention_backend == "cpu":
            return True
        return (self.attention_backend == "triton" and self.server_args.enable_deterministic_inference
                and not _cpu_ops_unavailable())

    def _build_attn_backend(self) -> AttentionBackend:
        if self.attention_backend == "triton":
            from sglite.layers.attention.triton_backend import TritonAttnBackend

            sa = self.server_args
            tile = (sa.triton_attention_split_tile_size or 256) if sa.enable_deterministic_inference else 0
            return TritonAttnBackend(self.device, self.num_kv_heads, split_tile=tile, context_len=self.context_len)
        if self.attention_backend == "cpu":
            from sglite.layers.attention.cpu_backend import CpuAttnBackend

            return CpuAttnBackend()
        if self.server_args.enable_deterministic_inference and self.tp_rank == 0:
            logger.warning("attention backend torch_native is not batch-invariant: a request's tokens may depend on "
                           "what it is batched with (the cpu backend's are not; docs/kernels.md, 'Batch invariance')")
        return TorchNativeAttnBackend()

    def init_cuda_graphs(self) -> None:
        """Capture decode forwards in CUDA graphs: CUDA only, backends that allow it."""
        self.cuda_graph_runner = None
        if not self.device.startswith("cuda") or self.server_args.disable_cuda_graph:
            return
        if self.tp_size > 1:
            if self.tp_rank == 0:
                logger.info("CUDA graphs off: sglite does not capture the all-reduces of --tp-size > 1")
            return
        if not self.attn_backend.supports_cuda_graph:
            logger.info("CUDA graphs off: the %s attention backend cannot be captured", self.attn_backend.name)
            return
        from sglite.model_executor.cuda_graph_runner import CudaGraphRunner

        self.cuda_graph_runner = CudaGraphRunner(self)

    def init_cpu_graph(self) -> None:
        """Run decode forwards as one C++ call: a CPU with the cpu attention backend."""
        self.cpu_graph_runner = None
        if self.attention_backend != "cpu" or self.server_args.disable_cpu_graph:
            return
        if self.tp_size > 1:
            if self.tp_rank == 0:
                logger.info("CPU graph off: its one C++ call has no all-reduce between layers (--tp-size > 1)")
            return
        from sglite.model_executor.cpu_graph_runner import CpuGraphRunner

        self.cpu_graph_runner = CpuGraphRunner(self)

    def profile_max_num_token(self) -> int:
        c = self.model_config
        cell = MHATokenToKVPool.cell_size(self.num_kv_heads, c.head_dim, c.num_hidden_layers, self.dtype)
        avail = _available_memory_bytes(self.device)
        frac = self.server_args.mem_fraction_static
        if self.device.startswith("cuda"):
            budget = avail * (frac if frac is not None else DEFAULT_MEM_FRACTION_CUDA)
        else:
            # weights already sit in RAM; give the KV pool a modest share of what is left,
            # shared by the tp ranks of this machine (they all see the same RAM free)
            ranks_here = self.tp_size // self.server_args.nnodes
            budget = avail * (frac if frac is not None else DEFAULT_MEM_FRACTION_CPU) / ranks_here
        return int(budget // cell)

    def init_memory_pool(self) -> None:
        sa = self.server_args
        c = self.model_config
        max_total = sa.max_total_tokens or self.profile_max_num_token()
        # every rank's pool has the same slots (rank 0's allocator hands them out for all)
        max_total = self.tp_group.all_reduce_min(max_total)
        max_total = max(sa.page_size, page_align_down(max_total, sa.page_size))
        self.max_total_num_tokens = max_total
        max_reqs = sa.max_running_requests or max(1, min(DEFAULT_MAX_RUNNING_REQUESTS_CAP, max_total // 2))
        self.max_running_requests = max_reqs
        # +1 row so a retracted-and-readmitted request always finds a slot; the overlap
        # loop holds freed rows back until the forward reading them is done, so twice that
        rows = (max_reqs + 1) * (1 if sa.disable_overlap_schedule else 2)
        self.req_to_token_pool = ReqToTokenPool(rows, self.context_len + REQ_TO_TOKEN_EXTRA_COLUMNS, self.device)
        if self.tp_size > 1:
            self.req_to_token_pool.track_rewrites()  # (ForwardBatchBroadcast carries them)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total, sa.page_size, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            max_total, sa.page_size, self.dtype, self.num_kv_heads, c.head_dim, c.num_hidden_layers, self.device
        )
        if self.tp_rank == 0:
            logger.info("KV pool: %d tokens, %d request slots", max_total, max_reqs)

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits: one row per request (its last row), or every row with return_all_logits.
        With tp > 1, rank 0 first sends the batch to the other ranks (``follow``); every
        rank then runs the forward on its shard, and the ranks' times are gathered into
        ``last_tp_timings``."""
        if self.tp_size == 1:
            return self._forward(forward_batch)
        if self.tp_group.is_first_rank:
            self.tp_group.broadcast_pyobj(ForwardBatchBroadcast.of(forward_batch))
        start, _ = time.perf_counter(), self.tp_group.take_comm_time()
        try:
            logits = self._forward(forward_batch)
        except TpRankDiedError:
            raise
        except Exception as e:  # the other ranks wait in this forward's collectives: no way back
            raise TpRankDiedError(f"tp rank {self.tp_rank}'s forward failed after the ranks started it, so they "
                                  f"are out of step ({type(e).__name__}: {e})") from e
        mine = [time.perf_counter() - start, self.tp_group.take_comm_time()]
        self.last_tp_timings = self.tp_group.gather_floats(mine)
        return logits

    def follow(self) -> None:
        """Ranks 1..N-1: run rank 0's forwards until it says stop (``shutdown``)."""
        while True:
            batch = self.tp_group.broadcast_pyobj(None)
            if batch is None:
                return
            self.forward(batch.to_forward_batch(self))

    def shutdown(self) -> None:
        """Rank 0 tells the other ranks to stop; every rank leaves the group."""
        if self.tp_size > 1 and self.tp_group.world_size > 1 and self.tp_group.is_first_rank:
            self.tp_group.broadcast_pyobj(None)
        self.leave_group()

    def leave_group(self) -> None:
        """Leave the tp group without a word to the others (shutdown's last step, or a
        rank died); rank 0 (maybe a user's process) gets its CPU threads back."""
        if self.tp_size > 1 and self.tp_group.world_size > 1:
            destroy_model_parallel()
            self.tp_group = get_tp_group()
        if self._cpu_threads_before is not None:
            restore_cpu_threads(*self._cpu_threads_before)
            self._cpu_threads_before = None

    def _forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        if self.cpu_graph_runner is not None and self.cpu_graph_runner.can_run(forward_batch):
            return self.cpu_graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def sample(self, logits: torch.Tensor, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled ids, and the rows' logprobs (Sampler.logprobs) when a request of
        the batch asked for them."""
        info = forward_batch.sampling_info
        if info.grammars is not None:
            if info.sampling_info_done is not None:
                info.sampling_info_done.wait()  # overlap: the scheduler fills the mask once the last round is in
            else:
                info.update_regex_vocab_mask()
        penalized = self.sampler.penalized(logits, info)
        ids = self.sampler.sample(penalized, info)
        wants = forward_batch.logprob is not None and any(forward_batch.logprob.return_logprob)
        return ids, self.sampler.logprobs(penalized, info) if wants else None
