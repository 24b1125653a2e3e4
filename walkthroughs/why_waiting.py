"""docs/seeds.md §A3 and §B5: PrefillAdder's budgets. Hold a request on each in turn and
read what ``Engine.explain`` says about it (docs/why.md)."""

from __future__ import annotations

from sglite import events as ev
from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough

SHARED = list(range(100, 140))  # 40 tokens two prompts share: past the 32-token in-batch threshold

# (case, server args, prompts, max_new_tokens, the request to ask about, its budget, need, have)
CASES = [
    ("KV pool", {"max_total_tokens": 400}, [[7] * 50, [8] * 50, [9] * 50, [10] * 50], 100,
     "r2", "rem_total_tokens", 150, 100),
    ("queue order", {"max_total_tokens": 400}, [[7] * 50, [8] * 50, [9] * 50, [10] * 50], 100,
     "r3", "not_reached", 0, 0),
    ("prefill budget", {"max_prefill_tokens": 128}, [[7] * 100, [8] * 100], 8, "r1", "rem_input_tokens", 100, 28),
    ("chunk budget", {"chunked_prefill_size": 64}, [[7] * 100, [8] * 10], 8, "r1", "rem_chunk_tokens", 0, 0),
    ("request limit", {"max_running_requests": 2}, [[7] * 10, [8] * 10, [9] * 10], 8,
     "r2", "max_running_requests", 3, 2),
    ("in-batch prefix", {"schedule_policy": "lpm"}, [SHARED + [1, 2], SHARED + [3, 4]], 8,
     "r1", "in_batch_prefix", 0, 0),
]

ADDER_DOT = """digraph adder {
  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10];
  offer [label="the next request in waiting_queue\\n(policy order)", shape=ellipse];
  mr [label="running + admitted\\n< max_running_requests?", shape=diamond];
  pool [label="prefill + reserved new tokens\\n< rem_total_tokens?", shape=diamond];
  inp [label="tokens to prefill <= rem_input_tokens\\n(or nothing admitted yet)?", shape=diamond];
  chunk [label="fits rem_chunk_tokens?", shape=diamond];
  adm [label="admitted"]; part [label="admitted, one chunk\\n(chunked_req)"];
  held [label="held: ReqHeld(budget, need, have)\\nthe rest: not_reached", style=filled, fillcolor="#fde2e2"];
  offer -> mr; mr -> pool [label="yes"]; mr -> held [label="no: max_running_requests"];
  pool -> inp [label="yes"]; pool -> held [label="no: rem_total_tokens"];
  inp -> chunk [label="yes"]; inp -> held [label="no: rem_input_tokens"];
  chunk -> adm [label="yes"]; chunk -> part [label="no, a page left"];
  chunk -> held [label="less than a page: rem_chunk_tokens"];
  adm -> offer [label="budgets left"]; part -> offer;
}"""


def held_in_first_round(args: dict, prompts: list[list[int]], max_new: int, rid: str) -> tuple[Engine, ev.ReqHeld]:
    """All prompts arrive together; after one iteration, the ReqHeld of ``rid``."""
    engine = Engine("tiny-random", disable_overlap_schedule=True, log_level="error", **args)
    for p in prompts:
        engine.submit(input_ids=p, sampling_params={"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True})
    engine.step()
    (held,) = [e for e in engine.history.events(rid) if isinstance(e, ev.ReqHeld)]
    return engine, held


def run(n: Narrator) -> None:
    n.title("Why is this request still waiting? PrefillAdder's budgets, one at a time",
            "这个请求为什么还在等？PrefillAdder 的预算，一个一个看")
    n.say("""Tutorial A (docs/seeds.md §A3): each round, get_new_batch_prefill offers the waiting requests,
          in the policy's order, to a PrefillAdder that holds the budgets — the KV pool less what running
          requests may still need (rem_total_tokens), max_prefill_tokens (rem_input_tokens), the chunk
          (rem_chunk_tokens) and the request limit — and charges each admission. The first refusal ends the
          round. sglite records, for every request left waiting, the budget that held it and the numbers: a
          ReqHeld event, which Engine.explain(rid) turns into words.""",
          """教程 A（docs/seeds.md §A3）：每一轮 get_new_batch_prefill 按调度策略的顺序把等待中的请求交给
          PrefillAdder。它持有各项预算——KV 池减去运行中请求可能还要的 Token（rem_total_tokens）、max_prefill_tokens
          （rem_input_tokens）、分块（rem_chunk_tokens）和请求数上限——并为每次准入记账。第一次拒绝就结束本轮。
          sglite 为每个留在队列里的请求记下挡住它的预算和具体数字：ReqHeld 事件，Engine.explain(rid) 把它写成文字。""")
    n.diagram("prefill-adder-budgets", ADDER_DOT)
    rows = []
    for case, args, prompts, max_new, rid, budget, need, have in CASES:
        _, held = held_in_first_round(args, prompts, max_new, rid)
        rows.append([case, ", ".join(f"{k}={v}" for k, v in args.items()), rid, held.budget, held.need, held.have,
                     held.detail])
        n.check((held.budget, held.need, held.have), (budget, need, have), f"{case}: {rid}", f"{case}：{rid}")
    n.table(["case", "server args", "rid", "budget", "need", "have", "detail"], rows)
    n.say("""Read the KV-pool row with tutorial A's arithmetic: each request needs its tokens to prefill plus a
          reserve for the tokens it may generate (max_new_tokens, clipped at 4096). r0 and r1 take 50 + 100
          each of the 400-token pool; r2 needs 150 and finds 100. r3 is never offered: admission stopped at r2.
          The prefill row: r0's 100 tokens leave 28 of max_prefill_tokens=128, and r1 needs 100.""",
          """用教程 A 的算法读 KV 池那一行：每个请求需要它要 prefill 的 Token，加上它可能生成的 Token 的预留
          （max_new_tokens，上限 4096）。r0 和 r1 各从 400 Token 的池里拿走 50 + 100；r2 需要 150，只剩 100。
          r3 根本没被考虑：准入停在了 r2。prefill 那一行：r0 的 100 个 Token 让 max_prefill_tokens=128 只剩 28，
          而 r1 需要 100。""")
    engine, _ = held_in_first_round(*CASES[0][1:4], "r2")
    while engine.scheduler.has_work():
        engine.step()
    n.step("The whole story of r3, as Engine.explain tells it", "Engine.explain 讲述的 r3 的完整经过")
    story = engine.explain("r3")
    n.code(story)
    n.check("held by an earlier request in the queue" in story and "held by the KV pool" in story, True,
            "r3 waited first on r2, then on the pool itself", "r3 先被 r2 挡住，随后被 KV 池本身挡住")


WALKTHROUGH = Walkthrough(
    "why-waiting",
    "why a request waits: hold one on each PrefillAdder budget and read Engine.explain",
    "请求为什么在等：让它依次被 PrefillAdder 的每项预算挡住，再读 Engine.explain",
    "docs/seeds.md §A3, §B5",
    run,
)
