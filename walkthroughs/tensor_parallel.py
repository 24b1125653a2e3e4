"""docs/tensor_parallel.md: --tp-size N. How SmolLM2's heads and weights are cut, why the
ranks' partial outputs sum (all-reduce) or concatenate (all-gather) to the unsharded
layer's, a real tp 2 run against tp 1, and the process layout: rank 0 alone schedules
and broadcasts each forward's batch."""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

import sglite.distributed.parallel_state as ps
from sglite import events as ev
from sglite.configs.model_config import ModelConfig
from sglite.distributed.utils import HeadShard, head_shard, valid_tp_sizes
from sglite.engine import Engine
from sglite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglite.layers.vocab_parallel_embedding import ParallelLMHead
from sglite.models.llama import LlamaForCausalLM
from walkthroughs.core import Narrator, Walkthrough

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
# float32: tp 2 adds the partial sums in another order than tp 1, which in bfloat16 rounds
# differently and can flip a greedy near-tie. The CPU (gloo, one machine) even where a GPU
# is: tp 2 on CUDA needs two of them
ENGINE_ARGS: dict[str, Any] = {"disable_overlap_schedule": True, "max_total_tokens": 512, "log_level": "error",
                               "dtype": "float32", "device": "cpu"}
FOLLOWER = "sglite::tp_worker_TP1"
TRANSPORT_ZH = {"shared memory": "共享内存", "gloo": " gloo "}  # what carries the collectives, in Chinese


@contextlib.contextmanager
def as_rank(rank: int, tp: int) -> Iterator[None]:
    """Layers built inside see themselves as rank ``rank`` of ``tp``. The group has no
    torch process group, so nothing built here may run a collective; the process's own
    group is back afterwards, whatever happens."""
    saved = ps._TP
    ps._TP = ps.GroupCoordinator(rank=rank, world_size=tp)
    try:
        yield
    finally:
        ps._TP = saved


def span(start: int, count: int) -> str:
    """Items start..start+count-1 as '0-5', or '2' for one."""
    return str(start) if count == 1 else f"{start}-{start + count - 1}"


@dataclass
class RankShapes:
    """One rank's local weights in one decoder layer, read off the built model."""

    heads: HeadShard
    qkv: tuple[int, ...]
    o_proj: tuple[int, ...]
    gate_up: tuple[int, ...]
    down: tuple[int, ...]
    vocab: tuple[int, int, int]  # vocab_start, vocab_end (exclusive), shard rows (with padding)


def rank_shapes(cfg: ModelConfig, tp: int) -> list[RankShapes]:
    """Build the whole model as each rank, on "meta" (shapes, no memory), as ModelRunner
    builds it before loading its shard."""
    out = []
    for r in range(tp):
        with as_rank(r, tp), torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        layer, emb = model.model.layers[0], model.model.embed_tokens
        attn, mlp = layer.self_attn, layer.mlp
        out.append(RankShapes(attn.qkv_proj.heads, tuple(attn.qkv_proj.weight.shape), tuple(attn.o_proj.weight.shape),
                              tuple(mlp.gate_up_proj.weight.shape), tuple(mlp.down_proj.weight.shape),
                              (emb.vocab_start, emb.vocab_end, emb.weight.shape[0])))
    return out


def show_head_split(n: Narrator) -> list[RankShapes]:
    cfg = ModelConfig()  # SmolLM2-135M's shapes
    n.step("1. SmolLM2-135M's heads at tp 2", "1. tp 2 时 SmolLM2-135M 的注意力头怎么分")
    n.say(f"""SmolLM2-135M has {cfg.num_attention_heads} query heads sharing {cfg.num_key_value_heads} KV heads
          (GQA: {cfg.num_attention_heads // cfg.num_key_value_heads} query heads per KV head). A rank must hold the KV
          head of every query head it computes, so head_shard (sglite/distributed/utils.py) cuts whole GQA groups:
          the KV heads are split as evenly as they go, each rank taking its KV heads' query heads.
          {cfg.num_key_value_heads} KV heads do not divide by 2, so the cut is uneven.""",
          f"""SmolLM2-135M 有 {cfg.num_attention_heads} 个 query 头，共用 {cfg.num_key_value_heads} 个 KV 头
          （GQA：每个 KV 头带 {cfg.num_attention_heads // cfg.num_key_value_heads} 个 query 头）。
          一个 rank 算哪些 query 头，就必须持有它们的 KV 头，所以 head_shard（sglite/distributed/utils.py）按整个 GQA 组来切：KV 头尽量均分，
          每个 rank 拿走自己 KV 头下的全部 query 头。{cfg.num_key_value_heads} 个 KV 头不能被 2 整除，所以两边不一样多。""")
    shards = rank_shapes(cfg, 2)
    h0, h1 = shards[0].heads, shards[1].heads
    n.check([span(h0.kv_start, h0.num_kv_heads), span(h0.q_start, h0.num_heads)], ["0-1", "0-5"],
            "rank 0: KV heads, query heads", "rank 0：KV 头、query 头")
    n.check([span(h1.kv_start, h1.num_kv_heads), span(h1.q_start, h1.num_heads)], ["2", "6-8"],
            "rank 1: KV heads, query heads", "rank 1：KV 头、query 头")
    n.say("""Each rank builds the same LlamaForCausalLM; every parallel layer reads the rank and the group
          size when it is built and allocates only its part. Built on "meta" as rank 0 and as rank 1
          (local weight shapes, [out, in]):""",
          """每个 rank 构建同一个 LlamaForCausalLM；每个并行层在构建时读取自己的 rank 和组大小，只分配自己那一份。
          分别以 rank 0 和 rank 1 的身份在 "meta" 设备上构建（本地权重形状，[out, in]）：""")
    n.table(["rank", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens rows (shard)",
             "KV heads in its pool"],
            [[r, list(s.qkv), list(s.o_proj), list(s.gate_up), list(s.down),
              f"{s.vocab[0]}..{s.vocab[1] - 1} ({s.vocab[2]})", span(s.heads.kv_start, s.heads.num_kv_heads)]
             for r, s in enumerate(shards)])
    d = cfg.head_dim
    n.check([s.qkv[0] for s in shards], [(s.heads.num_heads + 2 * s.heads.num_kv_heads) * d for s in shards],
            "qkv_proj rows = (its query heads + 2 x its KV heads) x head_dim",
            "qkv_proj 行数 = (query 头 + 2 x KV 头) x head_dim")
    n.check(sum(s.qkv[0] for s in shards), (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d,
            "qkv_proj rows over both ranks (the whole weight, nothing twice)",
            "两个 rank 的 qkv_proj 行数之和（整份权重，不重复）")
    n.check([s.o_proj[1] for s in shards], [s.heads.num_heads * d for s in shards],
            "o_proj columns = its query heads x head_dim", "o_proj 列数 = 自己的 query 头 x head_dim")
    n.check([s.down[1] for s in shards], [cfg.intermediate_size // 2] * 2,
            "down_proj columns (the MLP's intermediate features cut in half)",
            "down_proj 列数（MLP 中间维度对半切）")
    n.check([s.vocab[:2] for s in shards], [(0, cfg.vocab_size // 2), (cfg.vocab_size // 2, cfg.vocab_size)],
            "embedding rows [vocab_start, vocab_end) per rank",
            "每个 rank 的 embedding 行 [vocab_start, vocab_end)")
    return shards


def show_other_sizes(n: Narrator) -> None:
    cfg = ModelConfig()
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    tp3 = [head_shard(heads, kv, 3, r) for r in range(3)]
    n.say("""At tp 3 every rank holds one KV head and its query heads: an even cut. tp 4 has no cut
          that keeps each GQA group on one rank (more ranks than KV heads works only when each KV head can be
          replicated on tp / KV ranks and the query heads divide by tp), so it is refused before any process
          starts:""",
          """tp 3 时每个 rank 持有 1 个 KV 头和它的 query 头，正好均分。tp 4 找不到让每个 GQA 组留在同一个 rank 上
          的切法（rank 多于 KV 头时，只有每个 KV 头能复制到 tp / KV 个 rank 上、且 query 头数能被 tp 整除才行），所以在任何进程
          启动之前就被拒绝：""")
    n.check([(s.num_heads, s.num_kv_heads) for s in tp3], [(3, 1)] * 3, "tp 3: (query heads, KV heads) per rank",
            "tp 3：每个 rank 的 (query 头, KV 头)")
    try:
        head_shard(heads, kv, 4, 0)
        message = ""
    except ValueError as e:
        message = str(e)
    n.code(f"ValueError: {message}")
    n.check(valid_tp_sizes(heads, kv), [1, 2, 3, 9], "valid_tp_sizes(9, 3)", "valid_tp_sizes(9, 3)")
    n.check(message.endswith("sizes that can: 1, 2, 3, 9"), True, "the error names the sizes that work",
            "错误信息列出可行的 tp 大小")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: int) -> torch.Tensor:
    """Causal GQA attention over [rows, heads*d] tensors: query head i reads KV head
    i // (heads / kv_heads) (on a rank, its local heads keep that pairing)."""
    rows = q.shape[0]
    q, k, v = (t.reshape(rows, -1, d).transpose(0, 1) for t in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(rows, -1)


def attention_partials(x: torch.Tensor, w: dict[str, torch.Tensor], d: int, tp: int) -> list[torch.Tensor]:
    """Each rank's qkv shard -> attention over its heads -> o_proj over its columns: what
    it hands to the all-reduce (``matmul`` without the reduce)."""
    heads, kv_heads = w["q"].shape[0] // d, w["k"].shape[0] // d
    out = []
    for r in range(tp):
        with as_rank(r, tp):
            qkv = QKVParallelLinear(x.shape[1], d, heads, kv_heads)
            o = RowParallelLinear(heads * d, x.shape[1], input_shard=(qkv.heads.q_start * d, qkv.q_size))
        for part in "qkv":
            qkv.weight_loader("weight", w[part], part)
        o.weight_loader("weight", w["o"])
        q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        out.append(o.matmul(attend(q, k, v, d), None))
    return out


def mlp_partials(x: torch.Tensor, w: dict[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
    """Each rank's gate/up features -> SiLU(gate) * up -> down over those features."""
    inter, out = w["gate"].shape[0], []
    for r in range(tp):
        with as_rank(r, tp):
            gate_up = MergedColumnParallelLinear(x.shape[1], [inter, inter])
            down = RowParallelLinear(inter, x.shape[1])
        gate_up.weight_loader("weight", w["gate"], 0)
        gate_up.weight_loader("weight", w["up"], 1)
        down.weight_loader("weight", w["down"])
        gate, up = gate_up(x).chunk(2, dim=-1)
        out.append(down.matmul(F.silu(gate) * up, None))
    return out


def logit_shards(h: torch.Tensor, table: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each rank's LM head: the logits of its vocabulary rows (the last rank's padded)."""
    out = []
    for r in range(tp):
        with as_rank(r, tp):
            head = ParallelLMHead(table.shape[0], table.shape[1])
        head.weight_loader("weight", table)
        out.append(h @ head.weight.T)
    return out


def fmt(t: torch.Tensor) -> str:
    return " ".join(f"{v:+.3f}" for v in t.tolist())


def show_layer_math(n: Narrator) -> None:
    g = torch.Generator().manual_seed(0)
    hidden, d, heads, kv_heads, inter, tp = 16, 4, 9, 3, 24, 2
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    w = {"q": rand(heads * d, hidden), "k": rand(kv_heads * d, hidden), "v": rand(kv_heads * d, hidden),
         "o": rand(hidden, heads * d), "gate": rand(inter, hidden), "up": rand(inter, hidden),
         "down": rand(hidden, inter)}
    x = rand(5, hidden)
    n.step("2. One layer's math, by hand", "2. 手算一层")
    n.say(f"""SmolLM2's head counts ({heads} query, {kv_heads} KV) with head_dim {d} and hidden {hidden}, random
          weights, {x.shape[0]} rows. qkv_proj is column-parallel: each rank computes its heads' q, k, v and runs
          attention on them alone. o_proj is row-parallel: a rank holds the columns of its heads, so its output is a
          partial sum of the full o_proj output. The all-reduce adds the ranks' partials: that sum is the whole
          layer's.""",
          f"""取 SmolLM2 的头数（{heads} 个 query 头、{kv_heads} 个 KV 头），head_dim {d}、hidden {hidden}，随机权重，{x.shape[0]} 行输入。
          qkv_proj 是列并行（column-parallel）：每个 rank 只算自己那些头的 q、k、v，并只在它们上面做 attention。o_proj 是行并行
          （row-parallel）：一个 rank 持有自己那些头对应的列，所以它的输出只是完整 o_proj 输出的一个部分和。all-reduce 把
          各 rank 的部分和加起来：这个和就是整层的结果。""")
    full = attend(x @ w["q"].T, x @ w["k"].T, x @ w["v"].T, d) @ w["o"].T
    parts = attention_partials(x, w, d, tp)
    n.table(["", "row 0, features 0-3"],
            [["rank 0: o_proj partial", fmt(parts[0][0, :4])], ["rank 1: o_proj partial", fmt(parts[1][0, :4])],
             ["sum (the all-reduce)", fmt((parts[0] + parts[1])[0, :4])], ["unsharded o_proj", fmt(full[0, :4])]])
    n.check(torch.allclose(parts[0] + parts[1], full, atol=1e-5), True,
            "rank 0's o_proj partial + rank 1's == the unsharded attention output",
            "rank 0 的 o_proj 部分和 + rank 1 的 == 不切分时的 attention 输出")
    n.check(any(torch.allclose(p, full, atol=1e-5) for p in parts), False, "one rank's partial alone already equals it",
            "单个 rank 的部分和本身就等于它")
    mlp_full = (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
    n.check(torch.allclose(sum(mlp_partials(x, w, tp)), mlp_full, atol=1e-5), True,
            "the MLP the same way: gate_up shard -> SiLU -> down partials, summed",
            "MLP 同理：gate_up 分片 -> SiLU -> down 部分和，相加")
    show_logits_math(n, rand(11, hidden), rand(2, hidden), tp)


def show_logits_math(n: Narrator, table: torch.Tensor, h: torch.Tensor, tp: int) -> None:
    vocab = table.shape[0]
    n.say(f"""The LM head (and the embedding) is cut by vocabulary rows: ceil({vocab} / {tp}) rows each, the
          last rank's shard padded with zero rows so that every rank's logits have one shape. The all-gather puts
          the ranks' logits side by side; LogitsProcessor drops the padding.""",
          f"""LM head（以及 embedding）按词表的行切：每个 rank ceil({vocab} / {tp}) 行，最后一个 rank 的分片用全零行补齐，
          使每个 rank 的 logits 形状相同。all-gather 把各 rank 的 logits 横向拼起来，LogitsProcessor 再去掉补齐的部分。""")
    gathered = torch.cat(logit_shards(h, table, tp), dim=-1)
    n.check(gathered.shape[-1] - vocab, 1, "padding columns after the all-gather", "all-gather 之后补齐的列数")
    n.check(bool((gathered[:, vocab:] == 0).all()), True, "the padding logits are zero", "补齐部分的 logits 为零")
    n.check(torch.allclose(gathered[:, :vocab], h @ table.T, atol=1e-6), True,
            "the ranks' logit shards, concatenated, padding dropped == the full logits",
            "各 rank 的 logits 分片拼接、去掉补齐 == 完整 logits")


@contextlib.contextmanager
def tapped(group: ps.GroupCoordinator) -> Iterator[list[Any]]:
    """Record every object this group broadcasts, then broadcast it as usual: a wrapper
    on this one group object (as two_requests.py wraps a forward), removed on the way out."""
    sent: list[Any] = []
    real = group.broadcast_pyobj

    def broadcast_pyobj(obj: Any = None, src: int = 0) -> Any:
        sent.append(obj)
        return real(obj, src)

    group.broadcast_pyobj = broadcast_pyobj  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        del group.broadcast_pyobj


@dataclass
class TpRun:
    """What the tp 2 engine did: the PROMPTS run, then one probe request step by step."""

    config: ModelConfig
    outputs: list[list[int]]
    forwards: list[ev.ForwardFinished]  # of the PROMPTS run
    comm_calls: int  # all-reduces and all-gathers of the PROMPTS run, on rank 0
    broadcasts: int  # ForwardBatchBroadcasts of the PROMPTS run
    children: list[str]  # this process's child processes' names
    prefill: Any  # the probe's prefill broadcast (a ForwardBatchBroadcast)
    prefix_row: torch.Tensor  # rank 0's req_to_token row of that prefix, at that moment
    decode: Any  # the probe's decode broadcast
    decode_calls: int  # collectives of that one decode forward
    kv_shape: tuple[int, ...]  # rank 0's k_buffer of layer 0: [slots, KV heads, head_dim]
    transport: str  # what carries the forward's all-reduces and all-gathers


def run_tp2() -> TpRun:
    bus = ev.EventBus()
    forwards: list[ev.ForwardFinished] = []
    bus.subscribe(lambda e: forwards.append(e) if isinstance(e, ev.ForwardFinished) else None)
    # the with block shuts the engine down, and rank 1's process with it, even on a failure
    with Engine("tiny-random", tp_size=2, event_bus=bus, **ENGINE_ARGS) as engine:
        runner = engine.scheduler.tp_worker.model_runner
        group = runner.tp_group
        children = [p.name for p in multiprocessing.active_children()]
        with tapped(group) as sent:
            calls = group.comm_calls
            outputs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
            calls, n_sent, n_forwards = group.comm_calls - calls, len(sent), len(forwards)
            # extends PROMPTS[0], which the radix tree now holds: its prefill reuses that prefix
            engine.submit(input_ids=PROMPTS[0] + [40, 41], rid="probe",
                          sampling_params={**GREEDY, "max_new_tokens": 2})
            engine.step()
            prefill = sent[-1]
            table = runner.req_to_token_pool.req_to_token
            prefix_row = table[prefill.req_pool_indices[0], : prefill.prefix_lens[0]].clone()
            before = group.comm_calls
            engine.step()
            decode_calls, decode = group.comm_calls - before, sent[-1]
        kv_shape = tuple(runner.token_to_kv_pool.k_buffer[0].shape)
        # one machine's CPU ranks may share memory for the forward's collectives instead of gloo
        transport = "shared memory" if getattr(group, "shm", None) is not None else "gloo"
        return TpRun(engine.scheduler.model_config, outputs, forwards[:n_forwards], calls, n_sent, children,
                     prefill, prefix_row, decode, decode_calls, kv_shape, transport)


def show_real_run(n: Narrator) -> TpRun:
    n.step("3. tp 2 against tp 1 on tiny-random", "3. 在 tiny-random 上对比 tp 2 与 tp 1")
    n.say("""Engine("tiny-random", tp_size=2) makes this process rank 0 and starts rank 1 as a process of its
          own; the two meet at a port on 127.0.0.1 and form a gloo group. Both engines run the same two prompts
          greedily (float32: the ranks add their partial sums in another order than one rank does, which in
          bfloat16 rounds differently and could flip a near-tie).""",
          """Engine("tiny-random", tp_size=2) 让当前进程成为 rank 0，并把 rank 1 作为一个独立进程启动；两者在 127.0.0.1 的一个端口上
          会合，组成一个 gloo 进程组。两个引擎用贪心采样跑同样的两条 prompt（用 float32：两个 rank 累加部分和的顺序与单个 rank 不同，
          在 bfloat16 下舍入会不同，可能翻转一个几乎打平的 argmax）。""")
    with Engine("tiny-random", tp_size=1, **ENGINE_ARGS) as engine:
        tp1 = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        kv1 = tuple(engine.scheduler.tp_worker.model_runner.token_to_kv_pool.k_buffer[0].shape)
    run = run_tp2()
    n.check(run.outputs, tp1, "tp 2's output_ids == tp 1's", "tp 2 的 output_ids == tp 1 的")
    n.say("""ForwardFinished.tp_timings gives, per rank, the seconds of its forward and of the all-reduces /
          all-gather inside it (ModelRunner.last_tp_timings, gathered after each forward). Measured, not checked:
          on a CPU a collective returns once every rank's part is there, so its time includes waiting for the
          slower rank. What tensor parallelism costs and buys on SmolLM2 is measured in docs/tensor_parallel.md.""",
          """ForwardFinished.tp_timings 按 rank 给出它这次前向的秒数，以及其中 all-reduce / all-gather 的秒数
          （ModelRunner.last_tp_timings，每次前向后汇总）。这些是测量值，不做断言：在 CPU 上集合通信要等每个 rank 的数据都到齐
          才返回，所以它的时间里包含了等待较慢那个 rank 的时间。张量并行在 SmolLM2 上的代价与收益，
          请看 docs/tensor_parallel.md 中的测量。""")
    n.table(["bid", "mode", "bs", "rank 0 forward ms", "rank 0 collectives ms", "rank 1 forward ms",
             "rank 1 collectives ms"],
            [[e.bid, e.forward_mode, e.batch_size, *(f"{t * 1e3:.2f}" for rank in e.tp_timings for t in rank)]
             for e in run.forwards[:4]])
    n.check(all(len(e.tp_timings) == 2 for e in run.forwards), True, "every forward reports 2 ranks",
            "每次前向都报告 2 个 rank")
    show_collectives(n, run, kv1)
    return run


def show_collectives(n: Narrator, run: TpRun, kv1: tuple[int, ...]) -> None:
    layers = run.config.num_hidden_layers
    per_forward = 2 * layers + 2
    n.say(f"""Per forward: the embedding's all-reduce, two per decoder layer (after o_proj, after down_proj), and
          the LM head's all-gather. tiny-random has {layers} layers. GroupCoordinator.comm_calls counts them; here
          they go through {run.transport}.""",
          f"""每次前向：embedding 一次 all-reduce，每个 decoder 层两次（o_proj 之后、down_proj 之后），
          LM head 一次 all-gather。tiny-random 有 {layers} 层。GroupCoordinator.comm_calls 记录了调用次数；
          这里它们经由{TRANSPORT_ZH[run.transport]}完成。""")
    n.check(run.decode_calls, per_forward, "collectives in one decode forward (2 x layers + 2)",
            "一次 Decode 前向中的集合通信次数（2 x 层数 + 2）")
    n.check(run.comm_calls, per_forward * len(run.forwards),
            f"collectives over the {len(run.forwards)} forwards of the two prompts",
            f"两条 prompt 的 {len(run.forwards)} 次前向中的集合通信总数")
    heads = run.config.num_attention_heads, run.config.num_key_value_heads
    n.say("""Each rank's KV pool holds only its KV heads, at the same slot indices: rank 0's allocator hands
          out a slot, and every rank writes its heads' K and V there.""",
          """每个 rank 的 KV 池只存自己的 KV 头，槽位编号完全一致：rank 0 的 allocator 分配一个槽位，每个 rank 都
          把自己那些头的 K、V 写进这个槽位。""")
    n.check(run.kv_shape[1], head_shard(*heads, 2, 0).num_kv_heads,
            f"KV heads in rank 0's k_buffer {list(run.kv_shape)} (of {heads[1]})",
            f"rank 0 的 k_buffer {list(run.kv_shape)} 中的 KV 头数（共 {heads[1]} 个）")
    n.check([kv1[1], kv1[0]], [heads[1], run.kv_shape[0]], f"tp 1's k_buffer {list(kv1)}: all KV heads, the same slots",
            f"tp 1 的 k_buffer {list(kv1)}：全部 KV 头，槽位数相同")


def show_processes(n: Narrator, run: TpRun) -> None:
    n.step("4. Who does what: rank 0 schedules, rank 1 follows", "4. 分工：rank 0 调度，rank 1 跟随")
    n.say(f"""Rank 0 is this process: Scheduler, radix tree, KV allocator, TpModelWorker and a ModelRunner with
          its shard. Before each forward its ModelRunner.forward sends the decided batch with broadcast_pyobj: a
          ForwardBatchBroadcast, the ModelWorkerBatch's lists (input_ids, req_pool_indices, seq_lens,
          out_cache_loc, prefix_lens, extend_lens) plus prefix_slots, the KV slots of each extend row's cached
          prefix, which only rank 0's req_to_token table has. Rank 1 ({FOLLOWER}) runs ModelRunner.follow: no
          scheduler, no allocator, no radix tree, only its KV heads at the same slot indices.""",
          f"""rank 0 就是当前进程：Scheduler、radix tree、KV allocator、TpModelWorker，以及持有自己分片的 ModelRunner。
          每次前向之前，它的 ModelRunner.forward 用 broadcast_pyobj 发出已经决定好的 batch：一个 ForwardBatchBroadcast，
          内容是 ModelWorkerBatch 的几个列表（input_ids、req_pool_indices、seq_lens、out_cache_loc、prefix_lens、extend_lens），
          外加 prefix_slots，即每个 extend 行已缓存前缀所在的 KV 槽位，这些只有 rank 0 的 req_to_token 表里才有。rank 1
          （{FOLLOWER}）只运行 ModelRunner.follow：没有 scheduler、没有 allocator、没有 radix tree，只有自己的 KV 头，
          槽位编号与 rank 0 相同。""")
    n.check(FOLLOWER in run.children, True, f"a child process named {FOLLOWER}", f"有名为 {FOLLOWER} 的子进程")
    n.check(run.broadcasts, len(run.forwards), "ForwardBatchBroadcasts sent for the two prompts (one per forward)",
            "两条 prompt 发出的 ForwardBatchBroadcast 数（每次前向一个）")
    p = run.prefill
    n.table(["ForwardBatchBroadcast", "forward_mode", "input_ids", "seq_lens", "prefix_lens", "extend_lens",
             "prefix_slots", "pickled bytes"],
            [[name, m.forward_mode.name, m.input_ids.tolist(), m.seq_lens, m.prefix_lens, m.extend_lens,
              m.prefix_slots.tolist(), len(pickle.dumps(m))]
             for name, m in (("probe prefill", p), ("probe decode", run.decode))])
    n.check(p.prefix_lens, [len(PROMPTS[0])], "the probe's prefix found in the radix tree (its first prompt)",
            "probe 在 radix tree 中命中的前缀（第一条 prompt）")
    n.check(p.prefix_slots.tolist(), run.prefix_row.tolist(), "prefix_slots == rank 0's req_to_token row of the prefix",
            "prefix_slots == rank 0 的 req_to_token 中该前缀的槽位")
    n.check(run.decode.prefix_slots.numel(), 0, "prefix slots a decode sends (its earlier slots went with its prefill)",
            "Decode 发送的前缀槽位数（之前的槽位已随 Prefill 发过）")
    n.say("""SGLang does it differently: every rank runs a Scheduler; rank 0 broadcasts the new requests and each
          rank's scheduler makes the same decisions on them (which batch, which slots, whom to retract), which
          must come out identical on every rank. sglite has one decision stream, so nothing can diverge: request
          timeouts, a policy changed from the TUI, pause/step and the recovery of a failed round exist only once,
          in rank 0. The cost is one broadcast per forward carrying the batch (a pickle over the gloo cpu_group,
          the sizes above), where SGLang's broadcast, once per scheduler iteration too, carries only the requests
          that arrived, an empty list in most decode rounds.""",
          """SGLang 的做法不同：每个 rank 都运行一个 Scheduler；rank 0 广播新到的请求，各 rank 的 scheduler 在其上各自做同样的决定
          （组哪个 batch、用哪些槽位、retract 谁），而且这些决定必须在每个 rank 上完全一致。sglite 只有一条决策流，所以不会有分歧：
          请求超时、在 TUI 里改的策略、pause/step、失败轮次的恢复都只存在一份，在 rank 0 上。
          代价是每次前向都要广播一次整个 batch（经 gloo 的 cpu_group 发送一个 pickle，大小见上表）；SGLang 虽然也是每轮调度广播一次，但只带新到的请求，
          大多数 Decode 轮里是个空列表。""")
    n.diagram("tp-processes", tp_processes_dot(run))


def layer_shards_dot(shards: list[RankShapes], cfg: ModelConfig) -> str:
    """One SmolLM2 decoder layer at tp len(shards): each rank's column of shards, the two all-reduces."""
    d, colors = cfg.head_dim, ["#cfe2ff", "#d1f2d1", "#ffe3c4", "#eadcf8"]
    lines = ["digraph layer {", "  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10, style=filled];",
             f'  labelloc=t; label="one decoder layer of SmolLM2-135M at tp {len(shards)}";',
             f'  x [label="x [rows, {cfg.hidden_size}] after input_layernorm\\nreplicated on every rank", '
             'fillcolor=white];', '  ar1 [label="all-reduce (sum)", shape=ellipse, fillcolor="#ffd966"];',
             '  ar2 [label="all-reduce (sum)\\nthe next layer\'s input, on every rank", shape=ellipse, '
             'fillcolor="#ffd966"];']
    for r, s in enumerate(shards):
        h, c = s.heads, colors[r % len(colors)]
        first = sum(t.down[1] for t in shards[:r])  # this rank's intermediate features start here
        nodes = [("qkv", f"rank {r}: qkv_proj {list(s.qkv)}\\nq heads {span(h.q_start, h.num_heads)}, "
                         f"KV heads {span(h.kv_start, h.num_kv_heads)}"),
                 ("attn", f"attention: {h.num_heads} q heads\\nover KV heads {span(h.kv_start, h.num_kv_heads)}"),
                 ("o", f"o_proj {list(s.o_proj)}: partial\\ninput cols {span(h.q_start * d, h.num_heads * d)}"),
                 ("norm", "post_attention_layernorm\\nRMSNorm (replicated)"),
                 ("gu", f"gate_up_proj {list(s.gate_up)}\\nfeatures {span(first, s.down[1])} of gate and of up"),
                 ("silu", "SiLU(gate) * up"),
                 ("down", f"down_proj {list(s.down)}: partial\\ninput cols {span(first, s.down[1])}")]
        lines += [f'  {k}{r} [label="{label}", fillcolor="{c}"];' for k, label in nodes]
        lines += [f"  x -> qkv{r}; qkv{r} -> attn{r} -> o{r} -> ar1;",
                  f"  ar1 -> norm{r} -> gu{r} -> silu{r} -> down{r} -> ar2;"]
    lines.append("}")
    return "\n".join(lines)


def tp_processes_dot(run: TpRun) -> str:
    """The tp 2 engine's two processes, their shards and KV pools, and what passes between them."""
    cfg, layers = run.config, run.config.num_hidden_layers
    slots, _, d = run.kv_shape
    shards = [head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, 2, r) for r in (0, 1)]
    heads = [f"q heads {span(h.q_start, h.num_heads)}, KV heads {span(h.kv_start, h.num_kv_heads)}" for h in shards]
    # the same slots on both ranks (rank 0's allocator hands them out); each rank its own heads
    pools = [f'  kv{r} [shape=cylinder, label="KV pool: KV head{"s" * (h.num_kv_heads > 1)} '
             f'{span(h.kv_start, h.num_kv_heads)} of {cfg.num_key_value_heads}\\n'
             f'k/v_buffer [{slots}, {h.num_kv_heads}, {d}] x {layers} layers"];' for r, h in enumerate(shards)]
    return "\n".join([
        "digraph tp {", "  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10]; newrank=true;",
        '  labelloc=t; label="tiny-random at tp 2: one scheduler, two model runners";',
        '  subgraph cluster_r0 { label="this process: tp rank 0"; style=rounded;',
        '    sched [label="Scheduler\\nwaiting_queue, radix tree, KV allocator\\npolicies, timeouts, pause/step"];',
        '    worker [label="TpModelWorker\\n(samples the next tokens)"];',
        f'    mr0 [label="ModelRunner rank 0\\n{heads[0]}"];', pools[0],
        "    sched -> worker -> mr0 -> kv0; }",
        f'  subgraph cluster_r1 {{ label="process {FOLLOWER}: tp rank 1"; style=rounded;',
        '    idle [shape=plaintext, label="no Scheduler, no allocator,\\nno radix tree"];',
        f'    mr1 [label="ModelRunner.follow rank 1\\n{heads[1]}"];', pools[1],
        "    idle -> mr1 [style=invis]; mr1 -> kv1; }",
        '  bcast [shape=note, label="broadcast_pyobj(ForwardBatchBroadcast)\\ncpu_group (gloo), once per forward"];',
        f'  coll [shape=ellipse, label="{run.transport}: {2 * layers + 1} all-reduces\\n+ 1 all-gather per forward"];',
        "  mr0 -> bcast -> mr1; mr0 -> coll -> mr1 [dir=both, style=dashed];",
        "  { rank=same; sched; idle; } { rank=same; worker; bcast; }",
        "  { rank=same; mr0; mr1; } { rank=same; kv0; coll; }",
        "}"])


def run(n: Narrator) -> None:
    n.title("Tensor parallelism: one model cut across ranks", "张量并行：把一个模型切到多个 rank 上")
    n.say("""With --tp-size N (Engine(tp_size=N)) every rank holds a slice of every weight: its attention heads, a
          slice of the MLP's intermediate features, a slice of the vocabulary. A column-parallel layer followed
          by a row-parallel one needs no communication between them, so each half of a decoder layer ends in
          exactly one all-reduce (sglite/layers/linear.py).""",
          """使用 --tp-size N（Engine(tp_size=N)）时，每个 rank 持有每个权重的一部分：自己的注意力头、MLP 中间维度的一段、
          词表的一段。列并行层后面接行并行层，二者之间不需要通信，所以 decoder 层的前后两半各自只以一次 all-reduce 结束
          （sglite/layers/linear.py）。""")
    shards = show_head_split(n)
    show_other_sizes(n)
    show_layer_math(n)
    n.diagram("layer-shards", layer_shards_dot(shards, ModelConfig()))
    tp_run = show_real_run(n)
    show_processes(n, tp_run)


WALKTHROUGH = Walkthrough(
    "tensor-parallel",
    "--tp-size 2: SmolLM2's head split, partial sums that all-reduce to the layer, tp 2 vs tp 1, one scheduler",
    "--tp-size 2：SmolLM2 的头切分、all-reduce 相加成整层的部分和、tp 2 对比 tp 1、只有一个调度器",
    "docs/tensor_parallel.md",
    run,
)
