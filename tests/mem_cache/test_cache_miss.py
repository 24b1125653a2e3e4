"""Why a prompt was not all served from the cache (docs/why.md): the split of its
tokens by reason, on real RadixCache evictions and on hand-made cases."""

from __future__ import annotations

from sglite.engine import Engine
from sglite import events as ev
from sglite.mem_cache.cache_miss import CacheMiss, EvictionMemory, classify


def test_a_new_prompt_is_new_and_its_last_token_is_always_computed():
    m = classify([5, 6, 7, 8], 0, 1, EvictionMemory())
    assert m == CacheMiss(matched=0, evicted=0, evicted_at=0, page_tail=0, last_token=1, diverged_at=-1, rest=3)
    assert m.reason == "3 new: nothing cached starts like it; the last token (always computed)"


def test_all_cached_but_the_last_token():
    m = classify([5, 6, 7, 8], 3, 1, EvictionMemory())
    assert (m.matched, m.rest, m.last_token) == (3, 0, 1) and m.reason == "the last token (always computed)"


def test_past_the_shared_part():
    m = classify([5, 6, 7, 8, 9, 10], 2, 1, EvictionMemory())
    assert (m.matched, m.diverged_at, m.rest) == (2, 2, 3)
    assert m.reason.startswith("3 past token 2, where nothing cached continues like it")


def test_evicted_tokens_are_told_apart_from_new_ones():
    mem = EvictionMemory()
    mem.record((5, 6, 7, 8, 9), start=2, iteration=7, lru_rank=0)  # [5, 6] stayed cached
    m = classify([5, 6, 7, 8, 1, 2, 3], 2, 1, mem)
    assert (m.matched, m.evicted, m.evicted_at, m.diverged_at, m.rest) == (2, 2, 7, 4, 2)
    assert m.reason.startswith("2 evicted at iteration 7; 2 past token 4")


def test_a_last_partial_page_is_never_matched():
    # page 4: 10 tokens, the lookup covers 9 -> 8 matchable; all 8 cached
    m = classify(list(range(10)), 8, 4, EvictionMemory())
    assert (m.matched, m.page_tail, m.last_token, m.rest) == (8, 1, 1, 0)


def test_radix_cache_off():
    m = classify([1, 2, 3], 0, 1, None)
    assert m.radix_off and m.rest == 3 and m.reason == "radix cache off (--disable-radix-cache)"


def _admissions(engine: Engine, prompts: list[list[int]]) -> list[ev.CacheMatched]:
    log = ev.EventLog()
    unsubscribe = engine.event_bus.subscribe(log)
    for p in prompts:
        engine.generate(input_ids=p, sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    unsubscribe()
    return log.of(ev.CacheMatched)


def test_on_the_engine_a_prompt_evicted_then_sent_again_says_evicted():
    engine = Engine("tiny-random", max_total_tokens=256, log_level="error", disable_overlap_schedule=True)
    a = list(range(10, 110))  # 100 tokens
    fill = [list(range(120 + 100 * i, 220 + 100 * i)) for i in range(3)]  # three others push a out
    got = _admissions(engine, [a, *fill, a])
    first, again = got[0], got[-1]
    assert (first.matched_len, first.rest_len, first.evicted_len) == (0, 99, 0)
    assert again.evicted_len > 0 and again.matched_len + again.evicted_len + again.rest_len + 1 == 100
    assert again.evicted_at > first.iteration
    # the line docs/why.md quotes
    assert ("iteration 9: radix cache: 0 of 100 tokens cached; computed: 99 evicted at iteration 5; "
            "the last token (always computed)") in engine.explain(again.rid)
    hit = _admissions(engine, [a])[0]  # now it is cached again
    assert (hit.matched_len, hit.evicted_len, hit.rest_len) == (99, 0, 0)


def test_on_the_engine_a_shared_system_prompt_then_a_new_question():
    engine = Engine("tiny-random", log_level="error", disable_overlap_schedule=True)
    system = list(range(10, 60))
    got = _admissions(engine, [system + [1, 2, 3], system + [4, 5, 6, 7]])
    assert (got[1].matched_len, got[1].diverged_at, got[1].rest_len) == (50, 50, 3)
