"""docs/seeds.md §A3-§A5: two requests, a cached prefix, 9 prefill rows, 2 decode rows."""

from __future__ import annotations

from sglite.engine import Engine
from walkthroughs.core import Narrator, Walkthrough, batch_dot, radix_tree_dot

GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


def spy_forwards(engine: Engine) -> list:
    seen = []
    runner = engine.scheduler.tp_worker.model_runner
    real = runner.forward

    def forward(fb):  # noqa: ANN001, ANN202
        seen.append(fb)
        return real(fb)

    runner.forward = forward
    return seen


def run(n: Narrator) -> None:
    n.title("Two requests: admission, a 9-row prefill, a 2-row decode",
            "两条请求：接纳、9 行 Prefill、2 行 Decode")
    engine = Engine("tiny-random", max_total_tokens=256, disable_overlap_schedule=True)
    forwards = spy_forwards(engine)
    sched = engine.scheduler

    n.step("1. Warm the cache with a 3-token prefix", "1. 先用 3 个 Token 的前缀预热缓存")
    n.say("""A first request with prompt [11, 12, 13] runs and finishes after one token. When it
          finishes, cache_finished_req inserts the tokens whose KV was computed into the radix
          tree, so the KV of [11, 12, 13] stays in the pool, owned by the tree.""",
          """先跑一条 prompt 为 [11, 12, 13] 的请求，生成一个 Token 后结束。结束时 cache_finished_req
          把已经算过 KV 的 Token 插入 radix tree，于是 [11, 12, 13] 的 KV 留在池中，归树所有。""")
    engine.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 1}, rid="warm")
    n.check(sched.tree_cache.total_size(), 3, "tokens cached in the radix tree", "radix tree 中缓存的 Token 数")
    n.diagram("two-requests-tree-warm", radix_tree_dot(sched.tree_cache, "after the warm-up request"))

    n.step("2. R1 and R2 arrive and are admitted together", "2. R1、R2 到达并被一起接纳")
    r1, r2 = [21, 22, 23, 24, 25, 26], [11, 12, 13, 31, 32, 33]
    n.say("""R1 = [21..26] shares nothing with the cache. R2 = [11, 12, 13, 31, 32, 33] starts with the
          cached prefix. For each, init_next_round_input sets fill_ids = prompt + output and matches
          the longest cached prefix into prefix_indices; PrefillAdder.add_one_req checks the token
          budgets and admits both into can_run_list.""",
          """R1 = [21..26] 与缓存没有共同前缀；R2 = [11, 12, 13, 31, 32, 33] 以缓存的前缀开头。
          对每条请求，init_next_round_input 令 fill_ids = prompt + output，并把最长的缓存前缀匹配到
          prefix_indices；PrefillAdder.add_one_req 检查 Token 预算，把两条都放进 can_run_list。""")
    engine.submit(input_ids=r1, sampling_params=GREEDY, rid="R1")
    engine.submit(input_ids=r2, sampling_params=GREEDY, rid="R2")
    engine.step()
    batch = sched.cur_batch
    reqs = {r.rid: r for r in batch.reqs}
    n.table(["Req", "len(origin_input_ids)", "len(prefix_indices)", "extend_input_len", "len(fill_ids)"],
            [[rid, len(r.origin_input_ids), len(r.prefix_indices), r.extend_input_len, len(r.fill_ids)]
             for rid, r in reqs.items()])
    n.check([r.rid for r in batch.reqs], ["R1", "R2"], "can_run_list", "can_run_list")
    n.check(batch.prefix_lens, [0, 3], "ScheduleBatch.prefix_lens", "ScheduleBatch.prefix_lens")
    n.check(batch.extend_lens, [6, 3], "ScheduleBatch.extend_lens", "ScheduleBatch.extend_lens")
    n.check(batch.seq_lens, [6, 6], "ScheduleBatch.seq_lens", "ScheduleBatch.seq_lens")
    n.check(len(batch.input_ids), 9, "input rows of the prefill batch", "本轮 Prefill 的输入行数")
    n.check(len(batch.out_cache_loc), 9, "out_cache_loc slots (one per new row)", "out_cache_loc 槽位数（每个新行一个）")
    n.say("""Both requests are 6 tokens long, but the model computes 9 rows this round: the cache hit
          removed R2's first 3 rows from the work, not from its sequence.""",
          """两条请求长度都是 6，本轮模型却只算 9 行：缓存命中减少的是 R2 本轮要重算的范围，而不是它的序列长度。""")

    n.step("3. The ForwardBatch the model reads", "3. 模型读到的 ForwardBatch")
    fb = forwards[-1]
    n.table(["field", "value"], [
        ["forward_mode", fb.forward_mode.name], ["batch_size", fb.batch_size],
        ["input_ids", fb.input_ids.tolist()], ["positions", fb.positions.tolist()],
        ["extend_prefix_lens", fb.extend_prefix_lens.tolist()], ["extend_seq_lens", fb.extend_seq_lens.tolist()],
        ["extend_start_loc", fb.extend_start_loc.tolist()], ["out_cache_loc", fb.out_cache_loc.tolist()]])
    n.check(fb.positions.tolist(), [0, 1, 2, 3, 4, 5, 3, 4, 5], "positions", "positions")
    n.check(fb.extend_start_loc.tolist(), [0, 6], "extend_start_loc", "extend_start_loc")
    n.say("""Only the last row of each request needs logits: LogitsProcessor picks rows
          extend_start_loc + extend_seq_lens - 1, so 9 rows in give 2 rows of logits out.""",
          """每条请求只有最后一行需要 logits：LogitsProcessor 取 extend_start_loc + extend_seq_lens - 1 这两行，
          所以 9 行输入只产生 2 行 logits。""")
    n.diagram("two-requests-batch", batch_dot(batch, "the prefill batch: 9 rows"))

    n.step("4. The next round decodes T1 and T2", "4. 下一轮 Decode T1、T2")
    engine.step()
    fb = forwards[-1]
    t1, t2 = (r.output_ids[0] for r in sched.running_batch.reqs)
    n.check(fb.forward_mode.name, "DECODE", "forward_mode", "forward_mode")
    n.check(fb.input_ids.tolist(), [t1, t2], "input_ids are the sampled T1, T2", "input_ids 是采样出的 T1、T2")
    n.check(fb.positions.tolist(), [6, 6], "positions (seq_lens - 1)", "positions（seq_lens - 1）")
    n.say("""last_batch (the prefill) was merged into running_batch, no new prefill was possible, so
          update_running_batch ran prepare_for_decode: one new slot per request, seq_lens + 1.""",
          """上一轮的 Prefill batch 并入 running_batch；没有新的 Prefill，于是 update_running_batch 调用
          prepare_for_decode：每条请求分配一个新槽位，seq_lens 加一。""")
    while sched.has_work():
        engine.step()
    engine.step()  # the idle round's self-check
    n.check(engine.result("R2")["meta_info"]["cached_tokens"], 3, "R2 cached_tokens", "R2 的 cached_tokens")


WALKTHROUGH = Walkthrough(
    "two-requests",
    "prefix-cache admission, 9 prefill rows, 2 decode rows at position 6",
    "前缀缓存接纳、9 行 Prefill、位置 6 的 2 行 Decode",
    "docs/seeds.md §A3-§A5",
    run,
)
