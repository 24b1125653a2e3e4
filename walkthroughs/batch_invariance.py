"""docs/kernels.md, "Batch invariance": why a request's tokens could depend on what it was
batched with, shown on SmolLM2 in bfloat16. torch's kernels (the torch_native backend)
give a request other bits alone than in a batch, and at a near-tie in the logits other
tokens; the same sum added in two orders gives two float32 results, and bfloat16
rounding can turn that into a whole step; sglite's cpu kernels add every sum in one
order, so the same workload gives every request its solo tokens and logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "Water boils at a temperature of",
           "The three primary colors are", "To make a cup of tea, first", "The largest planet in our solar system is",
           "A haiku about autumn:", "The best way to learn a language is"]
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
# all eight at once: prompts cut into chunks of 16 rows, the decodes riding along in MIXED rounds
BATCHED = {"chunked_prefill_size": 16, "enable_mixed_chunk": True}


@dataclass
class Runs:
    """The eight prompts, each alone and all at once, on one attention backend."""

    backend: str
    solo: list[dict[str, Any]]
    batched: list[dict[str, Any]]
    head: torch.Tensor  # the LM head's weight [vocab, hidden] (tied: the embedding)

    def parting(self, i: int) -> int | None:
        """The first output step where request i's tokens differ (None: they never do)."""
        a, b = self.solo[i]["output_ids"], self.batched[i]["output_ids"]
        return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)

    def first_other_bits(self, i: int) -> int | None:
        """The first output step whose logprob differs in any bit."""
        a, b = (r["meta_info"]["output_token_logprobs"] for r in (self.solo[i], self.batched[i]))
        return next((j for j, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)


def run_both_ways(backend: str) -> Runs:
    common = {"dtype": "bfloat16", "attention_backend": backend, "log_level": "error"}
    with Engine(MODEL, **common) as engine:
        solo = [engine.generate(p, GREEDY, **LOGPROBS) for p in PROMPTS]
        head = engine.scheduler.tp_worker.model_runner.model.lm_head_weight.detach().float().clone()
    with Engine(MODEL, **common, **BATCHED) as engine:
        batched = engine.generate(PROMPTS, GREEDY, **LOGPROBS)
    return Runs(backend, solo, batched, head)


def show_symptom(n: Narrator) -> tuple[Runs, int]:
    n.step("1. The symptom: torch's kernels, alone and together", "1. 现象：torch 的 kernel，单独跑与一起跑")
    n.say(f"""SmolLM2-135M in bfloat16 with --attention-backend torch_native: its linear layers are torch's
          F.linear, its attention torch's SDPA, as sglite ran before 2026-12. Each of {len(PROMPTS)} prompts runs
          alone, then all {len(PROMPTS)} at once (chunks of {BATCHED['chunked_prefill_size']} rows, mixed rounds),
          greedy, {GREEDY['max_new_tokens']} tokens, with logprobs. Greedy decoding has no randomness: any
          difference comes from the arithmetic.""",
          f"""SmolLM2-135M，bfloat16，--attention-backend torch_native：线性层用 torch 的 F.linear，注意力用 torch 的
          SDPA，也就是 2026-12 之前 sglite 的做法。{len(PROMPTS)} 条 prompt 先各自单独跑，再 {len(PROMPTS)} 条一起跑
          （每块 {BATCHED['chunked_prefill_size']} 行的 chunked prefill，mixed 轮），greedy，{GREEDY['max_new_tokens']}
          个 token，带 logprobs。greedy 没有随机性：任何差异都来自算术本身。""")
    runs = run_both_ways("torch_native")
    rows = [[i, PROMPTS[i][:32], runs.first_other_bits(i), runs.parting(i)] for i in range(len(PROMPTS))]
    n.table(["req", "prompt", "first step with other logprob bits", "first step with another token"], rows)
    parted = [i for i in range(len(PROMPTS)) if runs.parting(i) is not None]
    n.check(len(parted) > 0, True, "some request's tokens changed with its batch", "有请求的 token 随 batch 改变")
    n.check(all(runs.first_other_bits(i) <= runs.parting(i) for i in parted), True,
            "the bits differed at or before the step where the token did", "比特的差异出现在 token 差异之时或之前")
    return runs, parted[0]


def show_near_tie(n: Narrator, runs: Runs, i: int) -> int:
    step = runs.parting(i)
    assert step is not None
    solo, batched = (r["meta_info"]["output_top_logprobs"][step] for r in (runs.solo[i], runs.batched[i]))
    n.step(f"2. The near-tie: request {i}, step {step}", f"2. 近乎平局：请求 {i}，第 {step} 步")
    n.say("""Up to this step both runs chose the same tokens; here their two best candidates are (logprob,
          token, text; a logprob difference is the logit difference):""",
          """到这一步之前两次运行选的 token 完全相同；这一步两个最好的候选是（logprob、token、文本；
          logprob 之差就是 logit 之差）：""")
    chose = [r["output_ids"][step] for r in (runs.solo[i], runs.batched[i])]
    n.table(["run", "1st", "2nd", "margin", "chose"],
            [[name, f"{a[0]:.7f} {a[1]} {a[2]!r}", f"{b[0]:.7f} {b[1]} {b[2]!r}", f"{a[0] - b[0]:.7f}", c]
             for name, (a, b), c in (("alone", solo, chose[0]), ("batched", batched, chose[1]))])
    n.check(runs.batched[i]["output_ids"][step] in [t for _, t, _ in solo], True,
            "the batched run's token was one of the two best alone", "一起跑时选中的 token 是单独跑时的前两名之一")
    n.say("""torch's bfloat16 LM head returns bfloat16 logits: between 8 and 16 the representable values are
          1/16 apart, between 16 and 32 1/8. Two tokens whose float32 logits are close round to the same value
          (a margin of exactly 0: argmax takes the lower token id) or to neighbours, and a change in the last
          bits of the hidden state moves a logit by a whole step.""",
          """torch 的 bfloat16 LM head 输出 bfloat16 的 logits：在 8 到 16 之间可表示的值相隔 1/16，16 到 32 之间相隔
          1/8。float32 logit 接近的两个 token 会舍入成同一个值（差距正好为 0：argmax 取 token id 较小的那个）或相邻的值；
          hidden state 末几位的变化就能让一个 logit 挪动整整一格。""")
    return step


def ordered_sums(x: np.ndarray, w: np.ndarray) -> dict[str, np.float32]:
    """sum_k x[k] * w[k] in float32, added in three orders (each add rounded, as hardware does)."""
    products = [np.float32(a) * np.float32(b) for a, b in zip(x, w)]
    one = np.float32(0)
    for p in products:  # one accumulator, k = 0, 1, 2, ...
        one = np.float32(one + p)
    lanes = [np.float32(0)] * 16
    for k, p in enumerate(products):  # 16 lanes (k mod 16), then a pairwise tree
        lanes[k % 16] = np.float32(lanes[k % 16] + p)
    while len(lanes) > 1:
        lanes = [np.float32(lanes[j] + lanes[j + 1]) for j in range(0, len(lanes), 2)]
    half = len(products) // 2
    first, second = np.float32(0), np.float32(0)
    for k, p in enumerate(products):  # two halves (two threads), then added
        if k < half:
            first = np.float32(first + p)
        else:
            second = np.float32(second + p)
    return {"one accumulator, k = 0..575": one, "16 lanes, then a tree": lanes[0],
            "two halves, then added": np.float32(first + second)}


def show_two_orders(n: Narrator, runs: Runs, i: int, step: int) -> None:
    n.step("3. One dot product, three orders", "3. 同一个点积，三种加法顺序")
    tokens = [t for _, t, _ in runs.solo[i]["meta_info"]["output_top_logprobs"][step]]
    history = runs.solo[i]["output_ids"][:step] or [tokens[0]]
    found = None
    for prev in reversed(history):  # real SmolLM2 rows: an embedding of an earlier token, a tied token's head row
        x = runs.head[prev].numpy()
        for t in tokens:
            sums = ordered_sums(x, runs.head[t].numpy())
            if len(set(sums.values())) > 1:
                found = (prev, t, sums)
                break
        if found:
            break
    n.check(found is not None, True, "orders that give different float32 sums, found",
            "找到了给出不同 float32 结果的加法顺序")
    assert found is not None
    prev, t, sums = found
    n.say(f"""A logit is a dot product over the hidden size, 576 products added up. Take two real rows of SmolLM2's
          weights, the embedding of token {prev} and the LM head's row of token {t} (one of the tied pair), and
          add their 576 products in float32 in three orders a kernel might use:""",
          f"""一个 logit 是 hidden 维度上的点积：576 个乘积相加。取 SmolLM2 权重里真实的两行：token {prev} 的 embedding，
          以及 token {t}（平局的一方）在 LM head 中的那一行，用 kernel 可能采用的三种顺序在 float32 中把 576
          个乘积加起来：""")
    n.table(["order", "float32 sum", "bits", "rounded to bfloat16"],
            [[name, f"{float(v):.9g}", f"{np.float32(v).view(np.uint32):08x}",
              f"{torch.tensor(float(v)).to(torch.bfloat16).item():.9g}"] for name, v in sums.items()])
    show_rounding_step(n, float(sums["one accumulator, k = 0..575"]))


def show_rounding_step(n: Narrator, value: float) -> None:
    """Two float32 values one unit in the last place apart, either side of the midpoint
    between two neighbouring bfloat16 values, round a whole bfloat16 step apart."""
    low = torch.tensor(value).to(torch.bfloat16)
    high = torch.nextafter(low, torch.tensor(float("inf"), dtype=torch.bfloat16))
    mid = (low.float() + high.float()) / 2
    below = torch.nextafter(mid, torch.tensor(-float("inf")))
    above = torch.nextafter(mid, torch.tensor(float("inf")))
    rounded = [x.to(torch.bfloat16).item() for x in (below, above)]
    n.say(f"""The orders part in the last bits of float32, a few parts in ten million. bfloat16 keeps 8 bits of
          mantissa: near {low.item():.6g} the next value up is {high.item():.6g}. A float32 sum that lands near
          the midpoint {mid.item():.9g} rounds either way depending on its last bit:""",
          f"""几种顺序只在 float32 的末几位不同，相差千万分之几。bfloat16 只保留 8 位尾数：在 {low.item():.6g}
          附近，下一个可表示的值是 {high.item():.6g}。落在中点 {mid.item():.9g} 附近的 float32 和，取决于最后一位，
          会舍入到不同方向：""")
    n.table(["float32", "bits", "bfloat16"],
            [[f"{x.item():.9g}", f"{x.numpy().view(np.uint32):08x}", f"{r:.6g}"] for x, r in zip((below, above), rounded)])
    n.check(rounded[0] != rounded[1], True, "one bit apart in float32, a whole step apart in bfloat16",
            "float32 中相差一位，bfloat16 中相差一整格")
    n.say("""A forward does this in every output of every linear layer, 30 layers deep, and rounds every
          layer's output to bfloat16: one value that rounds the other way changes the next layer's input.
          Which order a library picks depends on the shape: one row or 64, a chunk of 16 or a whole prompt,
          how many threads get a share of K. So a request's bits depend on its batch, and at a near-tie so
          does its token.""",
          """一次前向在每个线性层的每个输出上都这样做，共 30 层，并且每层的输出都舍入成 bfloat16：一个值舍入到
          另一边，就改变了下一层的输入。库采用哪种顺序取决于形状：一行还是 64 行，16 行的 chunk 还是整段
          prompt，K 被分给几个线程。所以请求的比特取决于它所在的 batch，遇到近乎平局时，token 也会随之改变。""")


def show_fixed_order(n: Narrator, before: Runs) -> None:
    n.step("4. sglite's fixed order: the cpu backend", "4. sglite 的固定顺序：cpu backend")
    n.say("""The cpu backend (a CPU's default) adds every sum in one order that depends only on the row's own
          data and position: each output of a linear layer in increasing k, whatever the number of rows or the
          thread; attention over KV ranges of 128 positions merged in position order; RMSNorm through one
          fixed tree (docs/kernels.md, "Batch invariance"). Its LM head returns the float32 sums: no bfloat16
          rounding of the logits. The same eight prompts, alone and together:""",
          """cpu backend（CPU 上的默认值）对每个求和都只用一种顺序，这种顺序只取决于该行自己的数据和位置：
          线性层的每个输出按 k 递增相加，与行数、线程无关；注意力按 128 个位置一段、按位置顺序合并；RMSNorm
          用一棵固定的树（docs/kernels.md，“Batch invariance”）。它的 LM head 直接返回 float32 的和，logits
          不再舍入成 bfloat16。同样的八条 prompt，单独跑与一起跑：""")
    after = run_both_ways("cpu")
    rows = [[runs.backend, sum(runs.parting(i) is None for i in range(len(PROMPTS))),
             sum(runs.first_other_bits(i) is None for i in range(len(PROMPTS)))] for runs in (before, after)]
    n.table(["backend", "requests with their solo tokens", "requests with their solo logprob bits"], rows)
    n.check(rows[1][1:], [len(PROMPTS), len(PROMPTS)], "cpu backend: every request's tokens and logprobs",
            "cpu backend：每条请求的 token 与 logprobs")
    n.say("""That is what lets `sglite replay --rerun` say "same" for a request whose scheduling changed, and
          makes a request's answer its own: tests/managers/test_batch_invariance.py and test_logprobs.py check
          it under retraction, chunking, cache hits and both event loops.""",
          """正因如此，`sglite replay --rerun` 才能对调度方式变了的请求回答 "same"，请求的结果也只取决于它自己：
          tests/managers/test_batch_invariance.py 与 test_logprobs.py 在 retraction、chunking、缓存命中和两种
          event loop 下检查这一点。""")


def _chain(prefix: str, ks: list[int]) -> tuple[list[str], str]:
    """Products p[k] for k in ``ks`` added one after another: the lines and the last node."""
    lines, last = [], f"{prefix}p{ks[0]}"
    for k in ks[1:]:
        node = f"{prefix}s{k}"
        lines.append(f'    {node} [label="+"]; {last} -> {node}; {prefix}p{k} -> {node};')
        last = node
    return lines, last


def orders_dot() -> str:
    """Eight products added in two orders: one chain, and two halves then added."""
    lines = ["digraph orders {", "  rankdir=BT; node [shape=circle, fontname=monospace, fontsize=10];",
             '  labelloc=t; label="the same 8 products, two orders: other roundings, other float32 bits";']
    for prefix, name in (("a", "one accumulator"), ("b", "two halves (two threads), then added")):
        lines.append(f'  subgraph cluster_{prefix} {{ label="{name}"; style=rounded;')
        lines += [f'    {prefix}p{k} [label="p{k}", shape=box];' for k in range(8)]
        if prefix == "a":
            lines += _chain("a", list(range(8)))[0]
        else:
            (first, end_a), (second, end_b) = _chain("b", [0, 1, 2, 3]), _chain("b", [4, 5, 6, 7])
            lines += first + second + [f'    bt [label="+"]; {end_a} -> bt; {end_b} -> bt;']
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


def run(n: Narrator) -> None:
    n.title("Why the batch changed my tokens", "为什么 batch 改变了我的 token")
    n.say("""A greedy request should get the same tokens whatever else runs beside it. In floating point, a sum
          depends on the order of its additions, and a kernel's order may depend on the batch's shape.""",
          """一条 greedy 请求，无论旁边还跑着什么，都应该得到相同的 token。但在浮点数里，和取决于加法的顺序，
          而 kernel 的加法顺序可能取决于 batch 的形状。""")
    before, i = show_symptom(n)
    step = show_near_tie(n, before, i)
    show_two_orders(n, before, i, step)
    n.diagram("sum-orders", orders_dot())
    show_fixed_order(n, before)


WALKTHROUGH = Walkthrough(
    "batch-invariance",
    "why the batch changed my tokens: a real near-tie in SmolLM2's logits, one sum in two orders, sglite's fixed order",
    "为什么 batch 改变了我的 token：SmolLM2 logits 中真实的近乎平局、同一个和的两种顺序、sglite 的固定顺序",
    "docs/kernels.md",
    run,
)
