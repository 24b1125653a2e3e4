"""Chunked prefill: a long prompt cut into chunks, each one round, with the decode tail
riding along in MIXED rounds; chunked_req across rounds."""

from __future__ import annotations

from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough, batch_dot

CHUNK = 16


def run(n: Narrator) -> None:
    n.title("Chunked prefill", "Chunked Prefill（分块预填充）")
    n.say(f"""chunked_prefill_size={CHUNK} caps the rows one round may prefill
          (PrefillAdder.rem_chunk_tokens). Here one request is already decoding and mixed chunk is on,
          so its decode row is taken from that budget first (mixed_with_decode_tokens): each chunk
          gets {CHUNK - 1} rows, and the 40-token prompt takes three rounds of 15, 15 and 10 rows. Between rounds the request is Scheduler.chunked_req: its computed part goes into the
          cache (cache_unfinished_req) and the next chunk starts from there. With
          --enable-mixed-chunk, a request that is already decoding joins each chunk's round as a
          1-token extend, so it is not starved (docs/seeds.md §B5.1).""",
          f"""chunked_prefill_size={CHUNK} 限制每轮最多 Prefill 的行数（PrefillAdder.rem_chunk_tokens）。
          这里已有一条请求在 Decode，且打开了 mixed chunk，它的 Decode 行先从预算中扣除（mixed_with_decode_tokens）：
          每块只得 {CHUNK - 1} 行，40 个 Token 的 prompt 分三轮：15、15、10 行。两轮之间它是 Scheduler.chunked_req：已算的部分
          进入缓存（cache_unfinished_req），下一块从那里继续。打开 --enable-mixed-chunk 后，正在 Decode 的请求
          以 1-token extend 的形式加入每一轮，不会被饿死（§B5.1）。""")
    engine = Engine("tiny-random", max_total_tokens=512, chunked_prefill_size=CHUNK, enable_mixed_chunk=True,
                    disable_overlap_schedule=True)
    sched = engine.scheduler
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    engine.submit(input_ids=[7, 8, 9], sampling_params=params, rid="short")
    engine.step()  # "short" is prefilled and starts decoding
    engine.submit(input_ids=list(range(20, 60)), sampling_params=params, rid="long")
    rows = []
    for _ in range(4):
        engine.step()
        b = sched.cur_batch
        n.diagram(f"chunked-prefill-round-{len(rows) + 1}", batch_dot(b, f"iteration {sched.iteration}"))
        rows.append([sched.iteration, b.forward_mode.name, [r.rid for r in b.reqs], b.prefix_lens, b.extend_lens,
                     len(b.input_ids), sched.chunked_req.rid if sched.chunked_req else "-"])
    n.table(["iteration", "forward_mode", "reqs", "prefix_lens", "extend_lens", "rows", "chunked_req after"], rows)
    n.check([r[1] for r in rows[:3]], ["MIXED", "MIXED", "MIXED"], "the three chunk rounds are MIXED",
            "三个分块轮都是 MIXED")
    n.check([r[4] for r in rows[:3]], [[CHUNK - 1, 1], [CHUNK - 1, 1], [40 - 2 * (CHUNK - 1), 1]], "extend_lens: chunk rows, then the decode row",
            "extend_lens：分块行，然后是 Decode 行")
    n.check([r[3][0] for r in rows[:3]], [0, CHUNK - 1, 2 * (CHUNK - 1)], "each chunk's prefix is what earlier chunks computed",
            "每块的 prefix 是前面各块算过的长度")
    n.check([r[6] for r in rows[:3]], ["long", "long", "-"], "chunked_req across rounds", "跨轮的 chunked_req")
    n.check([sum(r[4]) for r in rows[:3]], [CHUNK, CHUNK, 40 - 2 * (CHUNK - 1) + 1],
            "rows per round never exceed chunked_prefill_size", "每轮行数不超过 chunked_prefill_size")
    n.check(rows[3][1], "DECODE", "after the last chunk both decode", "最后一块之后两条一起 Decode")
    while sched.has_work():
        engine.step()
    engine.step()
    n.check(len(engine.result("long")["output_ids"]), 6, "long's output tokens", "long 的输出 Token 数")
    n.say("""A non-final chunk's sampled token is thrown away (process_batch_result skips a request
          whose is_chunked counter is positive): only the last chunk's logits predict the next token.""",
          """非最后一块采样出的 Token 会被丢弃（process_batch_result 跳过 is_chunked 计数为正的请求）：
          只有最后一块的 logits 才预测下一个 Token。""")


WALKTHROUGH = Walkthrough(
    "chunked-prefill",
    "a long prompt cut into chunks interleaved with decode; chunked_req across rounds",
    "长 prompt 分块、与 Decode 交错；跨轮的 chunked_req",
    "docs/seeds.md §B5, §B5.1",
    run,
)
