"""Following one request through its trace: the Perfetto timeline from a recording,
and Jaeger when a collector is running."""

from __future__ import annotations

import json
import os

from sglite import events as ev
from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough


def run(n: Narrator) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracing import setup_tracing
    from tracing.perfetto import events_to_chrome_trace

    n.title("Following one request through its trace", "沿着一条请求的 trace 走一遍")
    engine = Engine("tiny-random", max_total_tokens=2048, chunked_prefill_size=16, disable_overlap_schedule=True)
    log = ev.EventLog()
    engine.event_bus.subscribe(log)
    mem = InMemorySpanExporter()
    endpoint = os.environ.get("SGLITE_OTLP_ENDPOINT")  # e.g. localhost:4317 with Jaeger running
    tr = setup_tracing(engine.event_bus, 2, exporters=[mem], otlp_endpoint=endpoint, batch=False)
    engine.generate(input_ids=[[3, 4, 5, 6, 7], list(range(10, 50))],
                    sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, rid=["short", "long"])
    tr.shutdown()
    spans = mem.get_finished_spans()
    root = next(s for s in spans if s.name == "req long")
    stages = sorted((s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
                    key=lambda s: s.start_time)
    n.step("The request's trace", "这条请求的 trace")
    n.say("""One trace per request: the root span req <rid> runs from arrival to finish; its children
          are the stages. The 40-token prompt with chunked_prefill_size=16 shows one span per chunk.""",
          """每条请求一个 trace：根 span req <rid> 从到达持续到结束；子 span 是各个阶段。40 个 Token 的 prompt 在
          chunked_prefill_size=16 下每块一个 span。""")
    n.table(["span", "duration (ms)", "prefix_len", "extend_len"],
            [[s.name, f"{(s.end_time - s.start_time) / 1e6:.2f}", s.attributes.get("sglite.prefix_len", ""),
              s.attributes.get("sglite.extend_len", "")] for s in stages])
    n.check([s.name for s in stages], ["waiting", "prefill.chunk[0]", "prefill.chunk[1]", "prefill.chunk[2]", "decode"],
            "stages of req long", "req long 的各阶段")
    n.check(root.attributes["gen_ai.usage.output_tokens"], 4, "gen_ai.usage.output_tokens", "gen_ai.usage.output_tokens")
    dot = ["digraph spans {", "  rankdir=LR; node [shape=box, fontname=monospace, fontsize=10];",
           f'  root [label="{root.name}\\n{(root.end_time - root.start_time) / 1e6:.1f} ms"];']
    for i, s in enumerate(stages):
        dot += [f'  s{i} [label="{s.name}\\n{(s.end_time - s.start_time) / 1e6:.1f} ms"];', f"  root -> s{i};"]
    dot += [f"  s{i} -> s{i + 1} [style=dashed, constraint=false];" for i in range(len(stages) - 1)]
    n.diagram("tracing-req-long", "\n".join(dot + ["}"]))
    linked = [s for s in spans if s.name == "ScheduleBatch" and any(
        link.context.span_id == root.context.span_id for link in s.links)]
    n.say("""Each scheduler iteration that served the request is a ScheduleBatch span linked to it; in
          Jaeger, follow the link from the request to see what else was in each batch.""",
          """服务过这条请求的每一轮调度都是一个 ScheduleBatch span，并 link 到它；在 Jaeger 里从请求沿 link 就能看到每个
          batch 里还有谁。""")
    n.check(len(linked), 3 + 3, "iterations linked to req long (3 chunks, 3 decodes)",
            "link 到 req long 的轮次（3 块 Prefill，3 次 Decode）")

    n.step("The same run as a Perfetto timeline", "同一次运行的 Perfetto 时间线")
    trace = events_to_chrome_trace(log.events)
    tracks = sorted({e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"})
    n.check(tracks, ["forward", "iterations", "req long", "req short"], "tracks", "轨道")
    if n.out_dir is not None:
        n.out_dir.mkdir(parents=True, exist_ok=True)
        path = n.out_dir / "trace.perfetto.json"
        path.write_text(json.dumps(trace))
        n.say(f"Wrote {path}: open it at https://ui.perfetto.dev (or chrome://tracing).",
              f"已写出 {path}：在 https://ui.perfetto.dev（或 chrome://tracing）打开。")
    n.code("""sglite generate "Hello" --model-path tiny-random --record run.jsonl
              sglite trace convert run.jsonl --to perfetto run.perfetto.json
              sglite generate "Hello" --otlp-traces-endpoint localhost:4317   # Jaeger, see docs/tracing.md""")
    if endpoint:
        n.say(f"Spans were also sent to {endpoint}; look for service sglite in Jaeger.",
              f"span 也已发送到 {endpoint}；在 Jaeger 中查找服务 sglite。")


WALKTHROUGH = Walkthrough(
    "tracing",
    "follow one request through its trace (Perfetto file, and Jaeger when running)",
    "沿着一条请求的 trace 走（Perfetto 文件；Jaeger 运行时也可）",
    "docs/tracing.md",
    run,
)
