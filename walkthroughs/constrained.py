"""docs/structured_output.md: constrained decoding the SGLang way, on SmolLM2. One JSON
request, stepped iteration by iteration: it waits in the grammar_queue while a thread
compiles its schema against the vocabulary, moves to the waiting_queue, is prefilled,
and every token after that is sampled from logits the grammar's bitmask has cut down.
The table shows, per step, how many tokens the mask allowed, what the model wanted and
whether the mask refused it."""

from __future__ import annotations

import json

import jsonschema

from sglite import events as ev
from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough

MODEL = "smollm2-135m"
QUESTION = "Pick a T-shirt color and size."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "size"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}}
PARAMS = {"temperature": 0, "max_new_tokens": 64}
STEPS_SHOWN = 4  # the prefill's token and three decode steps

QUEUE_DOT = """digraph grammar_queue {
  rankdir=LR; node [shape=box, fontname=monospace, fontsize=10];
  arrive [label="handle_generate_request\\n(json_schema / regex / ebnf)", shape=ellipse];
  cache [label="compiled grammar\\ncached by key?", shape=diamond];
  gq [label="grammar_queue\\n(a pool thread compiles it\\nagainst the vocabulary)", style=filled, fillcolor="#fde2e2"];
  wq [label="waiting_queue"]; run [label="prefill, then decode"];
  mask [label="each step: fill the bitmask from\\nthe request's matcher; refused\\nlogits -> -inf; sample", style=filled, fillcolor="#e2f0fd"];
  accept [label="matcher.accept_token(sampled)"];
  arrive -> cache; cache -> wq [label="hit: its own matcher"]; cache -> gq [label="miss"];
  gq -> wq [label="move_ready_grammar_requests\\n(compiled)"]; wq -> run -> mask -> accept -> mask;
}"""


def step_through(engine: Engine, prompt: str) -> tuple[str, list[tuple[int, list[str], list[str]]]]:
    """Submit the request; step until it is admitted, noting each iteration's grammar_queue
    and waiting_queue; then run it to the end. Returns its rid and those notes."""
    rid = engine.submit(prompt, sampling_params={**PARAMS, "json_schema": json.dumps(SCHEMA)})
    notes = []
    sched = engine.scheduler
    while True:
        engine.step()
        queued = [r.rid for r in sched.grammar_manager.grammar_queue]
        notes.append((sched.iteration, queued, [r.rid for r in sched.waiting_queue]))
        if not queued:
            break
    while not engine.is_finished(rid):
        engine.step()
    return rid, notes


def show_queue(n: Narrator, rid: str, notes: list, log: ev.EventLog) -> None:
    n.step("1. The grammar_queue: compiled off the scheduler's thread", "1. grammar_queue：在调度线程之外编译")
    queued = next(e for e in log.events if isinstance(e, ev.GrammarQueued))
    ready = next(e for e in log.events if isinstance(e, ev.GrammarReady))
    rows = [[it, ", ".join(g) or "-", ", ".join(w) or "-"] for it, g, w in notes]
    n.table(["iteration", "grammar_queue", "waiting_queue"],
            rows[:3] + ([["…", "", ""]] if len(rows) > 4 else []) + rows[max(3, len(rows) - 1):])
    n.say(f"""The request arrived in iteration {queued.iteration}. Its json_schema was not in the backend's cache,
          so handle_generate_request put it in the grammar_queue, not the waiting_queue, and handed the
          compile to a thread: the scheduler went on iterating (it would have run other requests). Each
          iteration move_ready_grammar_requests looked at the compile; in iteration {ready.iteration}, after
          {ready.waited_iterations} iterations ({ready.waited_s * 1000:.0f} ms: this first compile also built
          xgrammar's view of the 49,152-token vocabulary), it was done and the request joined the
          waiting_queue.""",
          f"""请求在第 {queued.iteration} 次迭代到达。它的 json_schema 不在后端的缓存里，所以 handle_generate_request
          把它放进 grammar_queue 而不是 waiting_queue，并把编译交给一个线程：调度器照常迭代（有别的请求就照样运行）。
          每次迭代 move_ready_grammar_requests 查看编译是否完成；第 {ready.iteration} 次迭代，等了
          {ready.waited_iterations} 次迭代（{ready.waited_s * 1000:.0f} 毫秒：第一次编译还要建立 xgrammar 对
          49,152 个 Token 词表的视图）之后完成，请求进入 waiting_queue。""")
    n.check(notes[0][1:], ([rid], []), "while it compiles, the request is in grammar_queue, not waiting_queue",
            "编译期间请求在 grammar_queue 里，不在 waiting_queue 里")
    n.check(ready.iteration > queued.iteration, True, "it waited at least one iteration for its grammar",
            "它至少为语法等了一次迭代")
    n.diagram("grammar-queue", QUEUE_DOT)


def show_masks(n: Narrator, engine: Engine, log: ev.EventLog) -> list[ev.GrammarMasked]:
    n.step("2. The mask at each step", "2. 每一步的掩码")
    steps = [e for e in log.events if isinstance(e, ev.GrammarMasked)]
    tok = engine.tokenizer.decode
    vocab = engine.scheduler.model_config.vocab_size
    n.table(["output token", "allowed", "model wanted", "refused?", "sampled"],
            [[e.index, e.allowed, repr(tok([e.preferred])), "yes" if e.refused else "no", repr(tok([e.token_id]))]
             for e in steps[:STEPS_SHOWN]] + [["…", "", "", "", ""]] +
            [[e.index, e.allowed, repr(tok([e.preferred])), "yes" if e.refused else "no", repr(tok([e.token_id]))]
             for e in steps if e.refused and e.index >= STEPS_SHOWN])
    n.say(f"""Before each token the request's matcher fills its row of a bitmask (32 tokens per int32) with what
          the grammar allows next; SamplingBatchInfo applies it to the float32 logits (refused tokens become
          -inf) and the sampler draws as usual; the matcher then accepts the sampled token. "model wanted" is
          the argmax before the mask. At the first token the model wanted {tok([steps[0].preferred])!r}: an
          answer in words; the grammar allowed {steps[0].allowed} of the {vocab:,} tokens, each of them starting
          with an opening brace. Inside the object the model chooses only where the schema leaves a choice
          (which enum value, how much whitespace); the rest is spelled out for it.""",
          f"""每个 Token 之前，请求的 matcher 把语法允许的下一个 Token 填进位图里它那一行（每个 int32 放 32 个
          Token）；SamplingBatchInfo 把它作用在 float32 的 logits 上（被拒绝的 Token 变成 -inf），采样器照常抽样；
          然后 matcher 接受抽到的 Token。"model wanted" 是掩码之前的 argmax。第一个 Token 模型想要
          {tok([steps[0].preferred])!r}：用文字回答；语法只允许 {vocab:,} 个 Token 里的 {steps[0].allowed} 个，
          每个都以左花括号开头。进入对象之后，只有 schema 留了选择的地方（选哪个枚举值、多少空白）模型才真正在选；
          其余部分都是替它拼好的。""")
    n.check((steps[0].refused, tok([steps[0].token_id])), (True, "{"),
            "token 0: the model's choice is refused, '{' is sampled", "第 0 个 Token：模型的选择被拒绝，抽到 '{'")
    n.check(all(e.allowed < vocab for e in steps), True, "the mask narrowed every step",
            "每一步掩码都缩小了候选")
    return steps


def run(n: Narrator) -> None:
    n.title("Constrained decoding: the grammar_queue and the vocabulary mask, step by step",
            "约束解码：grammar_queue 与词表掩码，一步一步看")
    n.say("""A request with a json_schema, regex or ebnf must produce text its grammar accepts. SGLang compiles the
          grammar with xgrammar in the background while the request waits in a grammar_queue, then masks the
          vocabulary before every token. sglite does the same, with SGLang's names, and records each step.""",
          """带 json_schema、regex 或 ebnf 的请求必须输出语法接受的文本。SGLang 用 xgrammar 在后台编译语法，请求
          在 grammar_queue 里等待，之后每个 Token 之前都对词表加掩码。sglite 做法相同、名字相同，并记录每一步。""")
    with Engine(MODEL, log_level="error") as engine:
        log = ev.EventLog()
        engine.event_bus.subscribe(log)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
        rid, notes = step_through(engine, prompt)
        show_queue(n, rid, notes, log)
        steps = show_masks(n, engine, log)
        text = engine.result(rid)["text"]
        free = engine.generate(prompt, PARAMS)["text"]
        log.events.clear()
        again = engine.generate(prompt, {**PARAMS, "json_schema": json.dumps(SCHEMA)})
        explained = engine.explain(rid)
    n.step("3. The output, the unconstrained answer, and the cache", "3. 输出、不加约束的回答，以及缓存")
    n.code(text)
    n.code(free)
    jsonschema.validate(json.loads(text), SCHEMA)
    n.check(text.lstrip().startswith("{") and not free.lstrip().startswith("{"), True,
            "constrained: the schema's JSON; unconstrained: words", "加约束：符合 schema 的 JSON；不加：一段文字")
    n.check(any(isinstance(e, ev.GrammarQueued) for e in log.events), False,
            "the same schema again: a cache hit, no grammar_queue", "同一个 schema 再来：命中缓存，不进 grammar_queue")
    n.check(again["text"], text, "and the same tokens", "而且 Token 相同")
    n.code(explained)
    refused = sum(e.refused for e in steps)
    n.check(f"refused the model's first choice at {refused} of {len(steps)} output tokens" in explained, True,
            "Engine.explain tells the wait and the refusals", "Engine.explain 讲出了等待和拒绝")


WALKTHROUGH = Walkthrough(
    "constrained-decoding",
    "constrained decoding: a JSON request through the grammar_queue, and the vocabulary mask at each step",
    "约束解码：一个 JSON 请求走过 grammar_queue，以及每一步的词表掩码",
    "docs/structured_output.md",
    run,
)
