"""Retraction under KV pressure: new_token_ratio before and after, and recovery through
the cache with identical output."""

from __future__ import annotations

import random

from sglite import events as ev
from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough

GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(10, 30))] for _ in range(12)]


STATE_DOT = """digraph states {
  rankdir=LR; node [shape=ellipse, fontname=monospace, fontsize=10];
  Waiting -> Prefill [label="PrefillAdder admits"]; Prefill -> Running [label="first token"];
  Running -> Running [label="decode"]; Running -> Waiting [label="retract_decode", color=red, fontcolor=red];
  Running -> Finished [label="EOS / stop / length / abort"];
}"""


def run(n: Narrator) -> None:
    n.title("Retract under KV pressure", "KV 不足时的 retract")
    n.say("""PrefillAdder reserves only new_token_ratio of each running request's remaining tokens, so
          it admits more than a worst case would allow. When a decode step finds no free slot,
          update_running_batch calls retract_decode: the request with the fewest decoded tokens (ties:
          the longest prompt) goes back to the waiting queue until the rest have room for 20 more
          steps, and new_token_ratio is raised so admission becomes careful again.""",
          """PrefillAdder 对每条运行中请求的剩余 Token 只预留 new_token_ratio 的比例，所以接纳得比最坏情况多。
          当某一步 Decode 找不到空槽位时，update_running_batch 调用 retract_decode：已解码 Token 最少的请求
          （并列时取 prompt 最长的）退回等待队列，直到剩下的请求还能再跑 20 步；同时调高 new_token_ratio，
          让接纳重新变得谨慎。""")
    # a 256-token pool and a low schedule_conservativeness over-admit on purpose
    n.diagram("request-states", STATE_DOT)
    engine = Engine("tiny-random", max_total_tokens=256, schedule_conservativeness=0.05,
                    disable_overlap_schedule=True)
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    ps = prompts()
    outs = engine.generate(input_ids=ps, sampling_params=GREEDY)
    retracts = log.of(ev.ReqRetracted)
    first = retracts[0]
    n.step("The first retraction", "第一次 retract")
    same_round = [e for e in retracts if e.iteration == first.iteration]
    n.table(["iteration", "rid", "output tokens so far", "new_token_ratio before", "after"],
            [[e.iteration, e.rid, e.output_tokens, f"{e.old_new_token_ratio:.4f}", f"{e.new_token_ratio:.4f}"]
             for e in same_round])
    n.check(first.new_token_ratio > first.old_new_token_ratio, True, "the ratio goes up", "比例上升")
    n.check(min(e.output_tokens for e in same_round) == first.output_tokens, True,
            "the first retracted has the fewest decoded tokens", "最先退回的请求已解码 Token 最少")
    n.check(len(retracts), engine.scheduler.observer.num_retracted_reqs, "retract events = the scheduler's #retracted_reqs",
            "retract 事件数 = 调度器统计的 #retracted_reqs")

    n.step("Recovery through the cache", "通过缓存恢复")
    rid = first.rid
    again = [e for e in log.of(ev.ReqAdmitted) if e.rid == rid and e.iteration > first.iteration]
    readmit = again[: next(i for i, e in enumerate(again) if not e.chunked) + 1]  # its chunks, if any
    n.say("""A retracted request keeps its output_ids. When it is admitted again it prefills prompt +
          output so far (in chunks if that is longer than the chunk budget); its prompt was inserted into
          the radix tree right after its first prefill (cache_unfinished_req), so what is still cached is
          a hit.""",
          """被退回的请求保留 output_ids。再次被接纳时，它 Prefill 的是 prompt + 已生成的输出（超过分块预算时分块）；
          它的 prompt 在第一次 Prefill 后就已插入 radix tree（cache_unfinished_req），仍在缓存中的部分直接命中。""")
    n.table(["rid", "re-admitted at iteration", "prefix_len (reused)", "extend_len (computed)", "chunked"],
            [[rid, e.iteration, e.prefix_len, e.extend_len, e.chunked] for e in readmit])
    last = readmit[-1]
    n.check(last.prefix_len + last.extend_len, len(ps[int(rid[1:])]) + first.output_tokens,
            "after the last chunk, prefix + extend = prompt + output so far", "最后一块后 prefix + extend = prompt + 已有输出")
    n.check(readmit[0].prefix_len > 0, True, "the first re-admission reuses cached KV", "第一次重新接纳复用了缓存的 KV")
    alone = Engine("tiny-random", max_total_tokens=256).generate(input_ids=ps[int(rid[1:])], sampling_params=GREEDY)
    n.check(outs[int(rid[1:])]["output_ids"], alone["output_ids"], f"{rid}'s tokens equal a run alone",
            f"{rid} 的输出与单独运行时相同")


WALKTHROUGH = Walkthrough(
    "retract",
    "retract under KV pressure: new_token_ratio before/after, recovery through the cache",
    "KV 压力下的 retract：new_token_ratio 前后变化，经缓存恢复",
    "docs/seeds.md §A4, §A6",
    run,
)
