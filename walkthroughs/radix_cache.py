"""The radix cache: match, split, insert, lock, LRU eviction, with tree pictures; then
LPM vs FCFS admission order."""

from __future__ import annotations

import torch

from sglite.engine import Engine
from sglite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sglite.mem_cache.radix_cache import RadixCache
from walkthroughs.core import Narrator, Walkthrough, radix_tree_dot


def run(n: Narrator) -> None:
    n.title("The radix cache", "Radix cache")
    alloc = TokenToKVPoolAllocator(32)
    tree = RadixCache(ReqToTokenPool(2, 16), alloc)

    n.step("insert and match with a split", "insert 与带分裂的 match")
    slots = alloc.alloc(5)
    n.check(tree.insert([1, 2, 3, 4, 5], slots), 0, "insert [1 2 3 4 5]: tokens already present",
            "insert [1 2 3 4 5]：已存在的 Token 数")
    n.diagram("radix-1-insert", radix_tree_dot(tree, "insert [1 2 3 4 5]"))
    m = tree.match_prefix([1, 2, 3, 9])
    n.check(m.device_indices.tolist(), slots[:3].tolist(), "match [1 2 3 9] returns the slots of [1 2 3]",
            "match [1 2 3 9] 返回 [1 2 3] 的槽位")
    n.say("""The match stopped inside the node [1 2 3 4 5], so match_prefix split it into [1 2 3] and
          [4 5]: a request can now lock exactly the part it uses.""",
          """匹配停在节点 [1 2 3 4 5] 中间，于是 match_prefix 把它分裂成 [1 2 3] 和 [4 5]：请求可以只锁它用到的那一段。""")
    n.check(sorted(x.key_len for x in tree.snapshot() if x.parent_id != -1), [2, 3],
            "node sizes after the split", "分裂后的节点大小")
    n.diagram("radix-2-split", radix_tree_dot(tree, "after match [1 2 3 9]: split", {m.last_device_node.id}))
    s2 = alloc.alloc(3)
    n.check(tree.insert([1, 2, 3, 7, 8, 9], torch.cat([slots[:3], s2])), 3,
            "insert [1 2 3 7 8 9]: 3 tokens were already there (the caller frees those duplicate slots)",
            "insert [1 2 3 7 8 9]：已有 3 个 Token（调用方释放这些重复槽位）")

    n.step("lock and LRU eviction", "加锁与 LRU 淘汰")
    locked = tree.match_prefix([1, 2, 3, 4, 5]).last_device_node
    tree.inc_lock_ref(locked)
    n.check((tree.protected_size(), tree.evictable_size()), (5, 3), "(protected, evictable) after locking [1 2 3 4 5]",
            "锁住 [1 2 3 4 5] 后的 (protected, evictable)")
    n.diagram("radix-3-locked", radix_tree_dot(tree, "a request holds [1 2 3 4 5]", {locked.id}))
    free_before = alloc.available_size()
    tree.evict(8)
    n.check(alloc.available_size() - free_before, 3, "evict(8) frees only the unlocked leaf [7 8 9]",
            "evict(8) 只释放未加锁的叶子 [7 8 9]")
    tree.dec_lock_ref(locked)
    tree.evict(1)
    n.check(tree.total_size(), 3, "after unlocking, evict(1) removes the least recently used leaf [4 5]",
            "解锁后 evict(1) 淘汰最久未用的叶子 [4 5]")
    n.diagram("radix-4-evicted", radix_tree_dot(tree, "after eviction"))

    n.step("LPM vs FCFS admission order", "LPM 与 FCFS 的接纳顺序")
    n.say("""A 30-token prompt is cached; three requests arrive: new-1 and new-2 (25 new tokens each)
          and hit (the cached 30 tokens + 3 new). max_prefill_tokens=40 is the round's budget. FCFS
          admits in arrival order: new-1 takes 25 rows and new-2 no longer fits. lpm (longest prefix
          match) sorts hit first: it costs only 3 rows, so new-1 fits beside it.""",
          """缓存里有一段 30 个 Token 的 prompt；到达三条请求：new-1、new-2（各 25 个新 Token）和 hit（缓存的 30 个 Token 加
          3 个新 Token）。本轮预算 max_prefill_tokens=40。FCFS 按到达顺序：new-1 占 25 行，new-2 放不下了。lpm（最长前缀匹配）
          把 hit 排在最前：它只需 3 行，new-1 也放得下。""")
    orders = {}
    for policy in ("fcfs", "lpm"):
        engine = Engine("tiny-random", max_total_tokens=512, schedule_policy=policy, max_prefill_tokens=40,
                        chunked_prefill_size=40, disable_overlap_schedule=True)
        shared = list(range(100, 130))
        engine.generate(input_ids=shared + [5], sampling_params={"max_new_tokens": 1})
        params = {"max_new_tokens": 1}
        engine.submit(input_ids=list(range(200, 225)), sampling_params=params, rid="new-1")
        engine.submit(input_ids=list(range(300, 325)), sampling_params=params, rid="new-2")
        engine.submit(input_ids=shared + [7, 8, 9], sampling_params=params, rid="hit")
        engine.step()
        orders[policy] = [r.rid for r in engine.scheduler.cur_batch.reqs]
    n.table(["policy", "admitted first"], [[p, o] for p, o in orders.items()])
    n.check(orders, {"fcfs": ["new-1"], "lpm": ["hit", "new-1"]}, "first round per policy", "各策略第一轮接纳的请求")


WALKTHROUGH = Walkthrough(
    "radix-cache",
    "the radix cache: match, split, insert, lock, LRU eviction; LPM vs FCFS admission order",
    "Radix cache：match、分裂、insert、加锁、LRU 淘汰；LPM 与 FCFS 的接纳顺序",
    "docs/seeds.md §A3; SGLang mem_cache/radix_cache.py",
    run,
)
