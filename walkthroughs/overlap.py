"""docs/seeds.md §B6: event_loop_overlap against event_loop_normal on the same workload: the
future token ids, the one-round lag, the extra round of a finished request, both
timelines from the traces, and where the scheduler's time went."""

from __future__ import annotations

import json

from sglite import events as ev
from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough

PIPELINE_DOT = """digraph overlap {
  rankdir=LR; node [shape=box, fontname=monospace, fontsize=10]; newrank=true;
  subgraph cluster_s { label="scheduler thread"; style=rounded;
    p1 [label="plan 1"]; l1 [label="launch 1"]; p2 [label="plan 2\\n(inputs: futures of 1)"]; l2 [label="launch 2"];
    r1 [label="process 1"]; p3 [label="plan 3"]; l3 [label="launch 3"]; r2 [label="process 2"];
    p1 -> l1 -> p2 -> l2 -> r1 -> p3 -> l3 -> r2; }
  subgraph cluster_w { label="forward worker"; style=rounded;
    f1 [label="forward 1"]; f2 [label="forward 2\\n(resolve futures)"]; f3 [label="forward 3"]; f1 -> f2 -> f3; }
  l1 -> f1 [style=dashed]; l2 -> f2 [style=dashed]; l3 -> f3 [style=dashed];
  f1 -> r1 [style=dotted, label="tokens"]; f2 -> r2 [style=dotted, label="tokens"];
  { rank=same; p2; f1; } { rank=same; p3; f2; }
}"""

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20, 21, 22]]
LENGTHS = [6, 3, 8, 5]


def _run(overlap: bool) -> tuple[list[ev.Event], list[list[int]]]:
    engine = Engine("tiny-random", max_total_tokens=512, disable_overlap_schedule=not overlap)
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[{"max_new_tokens": n, **GREEDY} for n in LENGTHS])
    while engine.scheduler.has_work():
        engine.step()
    return log.events, [o["output_ids"] for o in outs]


def run(n: Narrator) -> None:
    from tracing.perfetto import events_to_chrome_trace
    from tracing.phases import scheduler_time

    n.title("The overlap loop: plan round N+1 while round N runs", "Overlap 循环：第 N 轮在跑时规划第 N+1 轮")
    n.say("""In event_loop_normal the scheduler waits for every forward: plan, run, process, then plan
          again. event_loop_overlap (SGLang's default, and sglite's: on CUDA, and on a CPU whose decode runs as the CPU graph) hands the forward to a worker and
          goes on: run_batch returns at once, the next round is planned while this one runs, and a
          round's results are processed one iteration later. The next round's decode inputs do not
          exist yet, so the scheduler writes placeholders, -index into a future map, and the worker
          swaps in the real tokens just before the forward.""",
          """在 event_loop_normal 里调度器等每一次前向：规划、运行、处理，然后再规划。event_loop_overlap（SGLang 的默认，
          sglite 在 CUDA 上、以及 decode 以 CPU graph 运行的 CPU 上的默认）把前向交给 worker 就继续：run_batch 立即返回，本轮在跑时下一轮已在规划，一轮的结果在下一轮迭代里
          才处理。下一轮 Decode 的输入这时还不存在，所以调度器写入占位符（future map 的 -index），worker 在前向之前才换成真实
          Token。""")
    n.diagram("overlap-pipeline", PIPELINE_DOT)

    n.step("Futures, step by step", "一步步看 future")
    engine = Engine("tiny-random", max_total_tokens=512, disable_overlap_schedule=False)
    sched = engine.scheduler
    engine.submit(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 4, **GREEDY}, rid="A")
    engine.submit(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 4, **GREEDY}, rid="B")
    engine.step()
    a, b = sched.cur_batch.reqs
    n.check(sched.cur_batch.forward_mode.name, "EXTEND", "iteration 1 launches", "第 1 轮发出")
    n.check([len(a.output_ids), len(b.output_ids)], [0, 0], "tokens back after iteration 1",
            "第 1 轮后拿到的 Token 数")
    futures = [a.future_token_id, b.future_token_id]
    n.check(all(f < 0 for f in futures), True, "A and B hold negative future ids", "A、B 持有负的 future id")
    engine.step()
    batch = sched.cur_batch
    n.table(["field", "A", "B"], [["future_token_id (after iteration 1)", *futures],
                                  ["decode input_ids (iteration 2's plan)", *batch.input_ids],
                                  ["seq_lens", *batch.seq_lens],
                                  ["output_ids after iteration 2", a.output_ids, b.output_ids]])
    n.check(batch.input_ids, futures, "iteration 2 decodes from the futures", "第 2 轮用 future 做 Decode")
    n.check(batch.seq_lens, [len(PROMPTS[0]) + 1, len(PROMPTS[1]) + 1], "seq_lens count the token being sampled",
            "seq_lens 计入正在采样的 Token")
    n.check([len(a.output_ids), len(b.output_ids)], [1, 1], "the prefill's tokens, processed in iteration 2",
            "Prefill 的 Token 在第 2 轮才处理")

    n.step("The same workload in both loops", "同一负载，两种循环")
    runs = {ov: _run(ov) for ov in (False, True)}
    for ov in (False, True):
        events = runs[ov][0]
        its = [e for e in events if isinstance(e, ev.IterationFinished) and (e.bid or e.processed_bid)]
        n.say("event_loop_overlap:" if ov else "event_loop_normal:", "event_loop_overlap：" if ov else "event_loop_normal：")
        n.table(["iteration", "launched (bid, mode)", "results processed (bid)"],
                [[e.iteration, f"{e.bid} {e.forward_mode}" if e.bid else "-", e.processed_bid or "-"] for e in its[:7]])
    normal_its = [e for e in runs[False][0] if isinstance(e, ev.IterationFinished) and e.bid]
    overlap_its = [e for e in runs[True][0] if isinstance(e, ev.IterationFinished) and e.bid]
    n.check(all(e.processed_bid == e.bid for e in normal_its), True,
            "normal: each iteration processes the batch it launched", "normal：每轮处理自己发出的 batch")
    n.check(all(e.processed_bid == e.bid - 1 for e in overlap_its[1:]), True,
            "overlap: each iteration processes the batch launched one iteration earlier",
            "overlap：每轮处理上一轮发出的 batch")
    n.check(runs[True][1], runs[False][1], "the tokens of every request", "每条请求的 Token")
    rounds = {ov: [sum(1 for e in runs[ov][0] if isinstance(e, ev.BatchPlanned) and f"r{i}" in e.rids)
                   for i in range(len(PROMPTS))] for ov in (False, True)}
    n.say("""A request that finishes in round N was already planned into round N+1 when round N's result
          said so: that round computes one token too many, which is dropped (never streamed) while its
          KV slot is freed once, with the rest of the request.""",
          """在第 N 轮结束的请求，在得知结果时已经被规划进了第 N+1 轮：那一轮多算了一个 Token，它被丢弃（从不流式输出），
          其 KV 槽位随请求其余部分只释放一次。""")
    n.check(rounds[False], LENGTHS, "rounds per request, normal (max_new_tokens)", "normal 下每条请求的轮数（max_new_tokens）")
    n.check(rounds[True], [x + 1 for x in LENGTHS], "rounds per request, overlap (one extra)",
            "overlap 下每条请求的轮数（多一轮）")

    n.step("Both timelines, and where the scheduler's time went", "两条时间线，以及调度器的时间去了哪里")
    times = {ov: scheduler_time(runs[ov][0]) for ov in (False, True)}
    n.table(["loop", "plan ms", "launch ms", "wait ms", "process ms", "forward ms", "hidden"],
            [["overlap" if ov else "normal", f"{t.plan * 1e3:.1f}", f"{t.launch * 1e3:.1f}", f"{t.wait * 1e3:.1f}",
              f"{t.process * 1e3:.1f}", f"{t.forward * 1e3:.1f}", f"{t.hidden_fraction:.0%}"] for ov, t in times.items()])
    n.check(times[False].hidden, 0.0, "normal: scheduler time hidden behind a forward", "normal：藏在前向后面的调度时间")
    n.say("""These times are measured, not checked: they depend on the machine. In the normal loop
          'launch' is the forward itself; in the overlap loop it only queues the forward, 'wait' is
          the scheduler idle until the forward it needs has finished, and 'hidden' is the share of
          planning and processing that ran while a forward was running. benchmarks/overlap.py
          measures the throughput this buys.""",
          """这些时间是测量值，不做断言：它们取决于机器。normal 循环里 launch 就是前向本身；overlap 循环里它只把前向排进队列，
          wait 是调度器等待所需前向完成的空闲时间，hidden 是规划与处理中与前向同时进行的比例。这换来的吞吐见
          benchmarks/overlap.py。""")
    if n.out_dir is not None:
        n.out_dir.mkdir(parents=True, exist_ok=True)
        for ov in (False, True):
            path = n.out_dir / f"{'overlap' if ov else 'normal'}.perfetto.json"
            path.write_text(json.dumps(events_to_chrome_trace(runs[ov][0])))
        n.say(f"Wrote normal.perfetto.json and overlap.perfetto.json to {n.out_dir}: open both at "
              "https://ui.perfetto.dev. In the overlap one, consecutive ScheduleBatch spans overlap (two "
              "lanes) and the next forward starts as soon as the previous one ends.",
              f"已写出 normal.perfetto.json 与 overlap.perfetto.json 到 {n.out_dir}：在 https://ui.perfetto.dev 打开两者。"
              "overlap 那份里相邻的 ScheduleBatch span 互相重叠（两条泳道），上一次前向一结束下一次就开始。")


WALKTHROUGH = Walkthrough(
    "overlap",
    "event_loop_overlap vs event_loop_normal: future ids, the one-round lag, both timelines",
    "event_loop_overlap 与 event_loop_normal：future id、一轮延迟、两条时间线",
    "docs/seeds.md §B6",
    run,
)
