"""A MIXED round: new prefill rows plus the decode tail as 1-token extends."""

from __future__ import annotations

from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough, batch_dot

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


def run(n: Narrator) -> None:
    n.title("A MIXED round", "MIXED 轮")
    n.say("""Continuous batching lets the set of requests change every round, but a prefill and
          running decodes share one forward only with --enable-mixed-chunk: get_new_batch_prefill then
          calls running_batch.prepare_for_decode() and new_batch.mix_with_running(running_batch), which
          appends every running request as a 1-token extend (extend_lens += [1] * bs) and sets
          ForwardMode.MIXED (docs/seeds.md §A4).""",
          """Continuous batching 让每轮的请求集合都可以变化，但 Prefill 与正在进行的 Decode 只有在打开
          --enable-mixed-chunk 时才共用一次 forward：此时 get_new_batch_prefill 先调用
          running_batch.prepare_for_decode()，再调用 new_batch.mix_with_running(running_batch)，把每条运行中请求
          作为 1-token extend 追加（extend_lens += [1] * bs），并设 ForwardMode.MIXED（§A4）。""")
    outputs = {}
    for mixed in (True, False):
        engine = Engine("tiny-random", max_total_tokens=512, enable_mixed_chunk=mixed,
                        disable_overlap_schedule=True)
        sched = engine.scheduler
        engine.submit(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, rid="A")
        engine.submit(input_ids=[9, 10, 11], sampling_params=GREEDY, rid="B")
        engine.step()  # A and B prefill
        engine.submit(input_ids=[12, 13, 14, 15, 16, 17], sampling_params=GREEDY, rid="C")
        engine.step()
        b = sched.cur_batch
        if mixed:
            n.step("The round where C arrives, mixed chunk on", "C 到达的那一轮（mixed chunk 打开）")
            n.table(["req", "prefix_len", "extend_len", "seq_len"],
                    [[r.rid, p, e, s] for r, p, e, s in zip(b.reqs, b.prefix_lens, b.extend_lens, b.seq_lens)])
            n.check(b.forward_mode.name, "MIXED", "forward_mode", "forward_mode")
            n.check([r.rid for r in b.reqs], ["C", "A", "B"], "new prefill rows first, then the decode tail",
                    "先是新的 Prefill 行，然后是 Decode 尾部")
            n.check(b.extend_lens, [6, 1, 1], "extend_lens", "extend_lens")
            n.check(b.prefix_lens, [0, 4, 3], "prefix_lens (a decode row's prefix is its whole past)",
                    "prefix_lens（Decode 行的 prefix 是它的全部历史）")
            n.check(len(b.input_ids), 8, "rows in the forward", "forward 的行数")
            n.diagram("mixed-round", batch_dot(b, "C prefills while A and B decode"))
        else:
            n.step("The same round, mixed chunk off", "同一轮（mixed chunk 关闭）")
            n.check([b.forward_mode.name, [r.rid for r in b.reqs]], ["EXTEND", ["C"]],
                    "prefill wins; A and B wait a round", "Prefill 优先；A、B 等一轮")
        while sched.has_work():
            engine.step()
        outputs[mixed] = {r: engine.result(r)["output_ids"] for r in "ABC"}
    n.check(outputs[True], outputs[False], "the tokens are the same either way", "两种方式生成的 Token 相同")


WALKTHROUGH = Walkthrough(
    "mixed",
    "a MIXED round: new prefill rows plus the decode tail as 1-token extends",
    "MIXED 轮：新的 Prefill 行加上作为 1-token extend 的 Decode 尾部",
    "docs/seeds.md §A4",
    run,
)
