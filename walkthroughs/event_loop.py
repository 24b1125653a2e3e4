"""docs/seeds.md §B4 and §B10: the six things one event_loop_normal iteration does, with the
seed's per-iteration print."""

from __future__ import annotations

from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough

LOOP_DOT = """digraph loop {
  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10];
  recv [label="1. recv_requests + process_input_requests"];
  next [label="2. get_next_batch_to_run"];
  run [label="3. run_batch"];
  proc [label="process_batch_result"];
  idle [label="4. self_check_during_idle"];
  last [label="5. last_batch = batch"];
  recv -> next; next -> run [label="batch"]; run -> proc; proc -> last;
  next -> idle [label="None"]; idle -> last; last -> recv [label="next iteration"];
}"""


def run(n: Narrator) -> None:
    n.title("The event loop: six things per iteration", "事件循环：每轮 6 件事")
    n.say("""Scheduler.step() is one iteration of event_loop_normal: (1) receive requests, (2)
          get_next_batch_to_run, (3) run_batch and process_batch_result, (4) when there was no batch,
          self_check_during_idle, (5) last_batch = batch. The seed adds two prints to the loop;
          sglite gets the same numbers from its event stream. SGLang runs event_loop_overlap
          by default, and so does sglite (on a CPU, when decode runs as the CPU graph); this
          walkthrough and the others that follow the seeds run the normal loop
          (disable_overlap_schedule=True), and `sglite walkthrough overlap` compares
          the two.""",
          """Scheduler.step() 就是 event_loop_normal 的一轮：(1) 收请求，(2) get_next_batch_to_run，
          (3) run_batch 并 process_batch_result，(4) 没有 batch 时 self_check_during_idle，(5) last_batch = batch。
          种子文章在循环里加了两行 print；sglite 从事件流里得到同样的数字。SGLang 默认运行
          event_loop_overlap，sglite 也是（在 CPU 上需 decode 以 CPU graph 运行）；本篇以及其他照着种子文章走的演练都
          运行 normal 循环（disable_overlap_schedule=True），
          两者的对比见 `sglite walkthrough overlap`。""")
    n.diagram("event-loop", LOOP_DOT)
    engine = Engine("tiny-random", max_total_tokens=512, disable_overlap_schedule=True)
    sched = engine.scheduler
    lines: list[str] = []
    modes: list[str] = []
    _instrument(sched, lines, modes)  # the seed's two prints, at the same two places
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    arrivals = {1: [[5, 6, 7, 8], [9, 10, 11]], 3: [[12, 13, 14, 15, 16]]}  # iteration -> prompts
    for it in range(1, 8):
        for p in arrivals.get(it, []):
            engine.submit(input_ids=p, sampling_params=params)
        engine.step()
    n.step("What the seed's prints show", "种子文章的 print 输出")
    n.code("\n".join(lines))
    n.check(modes, ["prefill", "decode", "prefill", "decode", "decode", "idle", "idle"],
            "what each iteration ran", "每一轮跑了什么")
    n.check(lines[:2], ["[recv] 2 new reqs; waiting=2 running=0", "[batch] prefill n_reqs=2 n_tokens=7"],
            "iteration 1: both arrivals are prefilled together", "第 1 轮：两条新请求一起 Prefill")
    n.check(lines[3:5], ["[recv] 1 new reqs; waiting=1 running=2", "[batch] prefill n_reqs=1 n_tokens=5"],
            "iteration 3: the new request's prefill goes first", "第 3 轮：新请求的 Prefill 先跑")
    n.say("""Iteration 3 shows the rule of docs/seeds.md §B5: a new prefill wins over decoding the running
          requests, which wait one round. Then all three decode together; when everything has
          finished the loop is idle and checks that no KV slot leaked.""",
          """第 3 轮体现了 §B5 的规则：新的 Prefill 优先，正在 Decode 的请求等一轮；之后三条一起 Decode；
          全部结束后循环空闲，并检查没有 KV 槽位泄漏。""")


def _instrument(sched, lines: list[str], modes: list[str]) -> None:  # noqa: ANN001
    """Wrap the scheduler's own methods, as the seed adds prints inside the loop."""
    real_input, real_next = sched.process_input_requests, sched.get_next_batch_to_run

    def process_input_requests(recv_reqs):  # noqa: ANN001, ANN202
        real_input(recv_reqs)
        if recv_reqs:
            lines.append(f"[recv] {len(recv_reqs)} new reqs; waiting={len(sched.waiting_queue)} "
                         f"running={sched.running_batch.batch_size()}")

    def get_next_batch_to_run():  # noqa: ANN202
        batch = real_next()
        if batch is None:
            modes.append("idle")
            lines.append("[idle] self_check_during_idle follows")
        else:
            mode = "prefill" if batch.forward_mode.is_extend() else "decode"
            modes.append(mode)
            lines.append(f"[batch] {mode} n_reqs={batch.batch_size()} n_tokens={len(batch.input_ids)}")
        return batch

    sched.process_input_requests, sched.get_next_batch_to_run = process_input_requests, get_next_batch_to_run


WALKTHROUGH = Walkthrough(
    "event-loop",
    "the six steps of event_loop_normal, with the seed's per-iteration print",
    "event_loop_normal 的 6 件事，以及种子文章的逐轮 print",
    "docs/seeds.md §B4, §B10",
    run,
)
