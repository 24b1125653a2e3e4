"""Property tests: random workloads x pool sizes x chunk sizes x policies x aborts, in
the normal and the overlap loop. Every request finishes or is aborted, no KV page leaks
at any step, and the radix tree's size accounting holds."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglite.engine import Engine
from sglite.server_args import SCHEDULE_POLICIES

request = st.tuples(
    st.lists(st.integers(3, 12), min_size=1, max_size=40),  # small alphabet: prefixes collide
    st.integers(1, 12),  # max_new_tokens
    st.integers(0, 30),  # arrival step
    st.one_of(st.none(), st.integers(0, 40)),  # abort at this step (if still alive)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=12),
    pool=st.sampled_from([64, 96, 160, 512]),
    chunk=st.sampled_from([-1, 4, 8, 32]),
    policy=st.sampled_from(SCHEDULE_POLICIES),
    page_size=st.sampled_from([1, 2, 4]),
    mixed=st.booleans(),
    radix=st.booleans(),
    overlap=st.booleans(),
)
def test_random_workloads_finish_without_leaks(reqs, pool, chunk, policy, page_size, mixed, radix, overlap):
    if chunk != -1 and chunk % page_size:
        chunk = page_size * 2
    engine = Engine("tiny-random", max_total_tokens=pool, chunked_prefill_size=chunk, schedule_policy=policy,
                    page_size=page_size, enable_mixed_chunk=mixed, disable_radix_cache=not radix,
                    max_running_requests=8, log_level="error", disable_overlap_schedule=not overlap)
    sched = engine.scheduler
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    rids: dict[int, str] = {}
    step = 0
    while pending or sched.has_work():
        while pending and reqs[pending[0]][2] <= step:
            i = pending.pop(0)
            prompt, max_new, _, _ = reqs[i]
            rids[i] = engine.submit(input_ids=prompt, sampling_params={
                "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True})
        for i, (_, _, _, abort_at) in enumerate(reqs):
            if abort_at == step and i in rids:
                engine.abort(rids[i])
        engine.step()
        sched.runtime_checker.self_check_during_busy()
        tree = sched.tree_cache
        assert tree.evictable_size() + tree.protected_size() == tree.total_size()
        step += 1
        assert step < 5000, "no progress"
    engine.step()  # idle: self_check_during_idle raises on a leak
    assert len(rids) == len(reqs)
    for i, rid in rids.items():
        res = engine.result(rid)
        reason = res["meta_info"]["finish_reason"]["type"]
        assert reason in ("length", "abort"), res
        if reason == "length":
            assert len(res["output_ids"]) == res["meta_info"]["finish_reason"]["length"]
    assert sched.tree_cache.protected_size() == 0
