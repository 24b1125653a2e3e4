"""docs/seeds.md §B13, question 5: the waiting_queue keeps growing — cache misses or too small
a token budget? Diagnosed from the event stream alone."""

from __future__ import annotations

import random
from collections import Counter

from sglite import events as ev
from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough


DIAGNOSIS_DOT = """digraph diagnose {
  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10];
  q [label="waiting_queue grows", shape=ellipse];
  s [label="AdmissionStopped.reason\\nwhile requests wait?", shape=diamond];
  nt [label="KV pool too small:\\n--max-total-tokens, fewer running requests"];
  ot [label="prefill budget too small:\\n--max-prefill-tokens, --chunked-prefill-size"];
  h [label="cache_hit_rate low?", shape=diamond];
  cm [label="cache misses: prompts recomputed;\\nshared prefixes? --schedule-policy lpm"];
  ok [label="neither: the model is the bottleneck"];
  q -> s; s -> nt [label="NO_TOKEN"]; s -> ot [label="OTHER"]; s -> h [label="none"];
  h -> cm [label="yes"]; h -> ok [label="no"];
}"""


def diagnose(events: list[ev.Event]) -> tuple[str, dict]:
    """A verdict from events only: why admission stopped while requests waited, and the
    cache hit rate."""
    stops = Counter(e.reason for e in events if isinstance(e, ev.AdmissionStopped) and e.waiting > 0)
    last = [e for e in events if isinstance(e, ev.IterationFinished)][-1]
    facts = {"admission stops while waiting": dict(stops), "cache hit rate": round(last.cache_hit_rate, 3),
             "max waiting": max(e.num_waiting for e in events if isinstance(e, ev.IterationFinished))}
    if stops.get("NO_TOKEN", 0) and stops["NO_TOKEN"] >= stops.get("OTHER", 0):
        return "token budget: the KV pool (NO_TOKEN) stops admission", facts
    if stops.get("OTHER", 0):
        return "token budget: max_prefill_tokens / chunk budget (OTHER) stops admission", facts
    if last.cache_hit_rate < 0.2:
        return "cache misses: every prompt is computed in full", facts
    return "neither: budgets hold and prompts hit the cache", facts


def scenario(n_reqs: int, shared: bool, **kw) -> list[ev.Event]:
    engine = Engine("tiny-random", disable_overlap_schedule=True, **kw)
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    rng = random.Random(0)
    system = [rng.randrange(3, 250) for _ in range(120)]
    prompts = [(system if shared else [rng.randrange(3, 250) for _ in range(120)]) + [rng.randrange(3, 250)
               for _ in range(8)] for _ in range(n_reqs)]
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    return log.events


def run(n: Narrator) -> None:
    n.title("The waiting_queue keeps growing: cache misses or too small a budget?",
            "waiting_queue 持续增长：是 cache miss 多，还是 Token 预算太小？")
    n.say("""Two signals in the events answer it. AdmissionStopped says, every round, why PrefillAdder
          stopped while requests were still waiting: NO_TOKEN (the KV pool, rem_total_tokens) or OTHER
          (max_prefill_tokens or the chunk budget). IterationFinished carries the cache hit rate: a low
          rate with long shared-looking prompts means every request recomputes its prompt.""",
          """事件里有两个信号。AdmissionStopped 每轮说明在仍有请求等待时 PrefillAdder 为什么停下：NO_TOKEN（KV 池，
          rem_total_tokens）或 OTHER（max_prefill_tokens 或分块预算）。IterationFinished 带着缓存命中率：命中率低而
          prompt 又长，说明每条请求都在重算自己的 prompt。""")
    cases = {
        "small KV pool, shared prompts": scenario(24, True, max_total_tokens=400, max_running_requests=64),
        "distinct prompts, small prefill budget": scenario(24, False, max_total_tokens=8192,
                                                           max_prefill_tokens=256, chunked_prefill_size=256),
        "distinct prompts, big budgets": scenario(24, False, max_total_tokens=8192, chunked_prefill_size=-1),
        "shared prompts, lpm": scenario(24, True, max_total_tokens=8192, schedule_policy="lpm"),
    }
    rows, verdicts = [], {}
    for name, events in cases.items():
        verdict, facts = diagnose(events)
        verdicts[name] = verdict.split(":")[0]
        rows.append([name, facts["max waiting"], facts["admission stops while waiting"], facts["cache hit rate"],
                     verdict])
    n.table(["scenario", "max waiting", "why admission stopped", "hit rate", "verdict"], rows)
    n.check(verdicts, {"small KV pool, shared prompts": "token budget",
                       "distinct prompts, small prefill budget": "token budget",
                       "distinct prompts, big budgets": "cache misses",
                       "shared prompts, lpm": "neither"},
            "verdicts", "诊断结论")
    hit = {name: diagnose(e)[1]["cache hit rate"] for name, e in cases.items()}
    n.check(hit["distinct prompts, big budgets"] < 0.01, True, "distinct prompts: almost nothing to hit",
            "不同的 prompt：几乎没有可命中的")
    n.check(hit["shared prompts, lpm"] > 0.8, True, "shared prompts with lpm: most prompt tokens hit",
            "共享 prompt 加 lpm：大多数 prompt Token 命中")
    n.diagram("growing-queue-diagnosis", DIAGNOSIS_DOT)
    n.say("""So: if AdmissionStopped is mostly NO_TOKEN, give the pool more memory (--max-total-tokens,
          --mem-fraction-static) or lower max_running_requests; if it is OTHER, raise
          --max-prefill-tokens / --chunked-prefill-size; if neither and the hit rate is low, the prompts are
          recomputed: if they do share prefixes, --schedule-policy lpm computes a shared prefix once.""",
          """所以：AdmissionStopped 多为 NO_TOKEN 时，给 KV 池更多内存（--max-total-tokens、--mem-fraction-static）或降低
          max_running_requests；多为 OTHER 时，调大 --max-prefill-tokens / --chunked-prefill-size；两者都不是而命中率低，
          说明 prompt 在被重算：若它们确实共享前缀，--schedule-policy lpm 能让共享前缀只算一次。""")


WALKTHROUGH = Walkthrough(
    "growing-queue",
    "a growing waiting_queue: cache misses or too small a token budget? diagnosed from the events",
    "waiting_queue 持续增长：cache miss 还是预算太小？用事件诊断",
    "docs/seeds.md §B13 question 5",
    run,
)
