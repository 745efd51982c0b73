"""The block pool, prefix hashing and the scheduler as pure bookkeeping (no model)."""

from __future__ import annotations

import pytest

from stages.serve.kv_cache import KVCacheManager, hash_block, kv_bytes_per_token, num_blocks_for_budget
from stages.serve.request import Request
from stages.serve.sampling import SamplingParams
from stages.serve.scheduler import Scheduler, SchedulerConfig, StepResult


def test_kv_sizing_follows_the_seed():
    # seed: 2 x 5 layers x 32 heads x 128 x 2 bytes = 80 KB/token; GQA with 8 KV heads: 20 KB
    assert kv_bytes_per_token(5, 32, 128, 2) == 80 * 1024
    assert kv_bytes_per_token(5, 8, 128, 2) == 20 * 1024
    assert num_blocks_for_budget(20 * 1024 * 16 * 10 + 5, 16, 20 * 1024) == 10
    with pytest.raises(ValueError, match="smaller than one block"):
        num_blocks_for_budget(100, 16, 20 * 1024)


def test_block_pool_refcounts_prefix_hits_and_lru_eviction():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = [1, 2, 3, 4, 5]
    assert kv.allocate_slots("a", len(a))
    assert kv.pool.num_free == 1
    kv.cache_full_blocks("a", a, 5)  # blocks [1,2] and [3,4] are full and computed
    assert len(kv.pool.cached) == 2
    # a second request with the same first four tokens shares both blocks
    b = [1, 2, 3, 4, 9, 9]
    hits, n = kv.get_computed_blocks("b", b)
    assert n == 4 and [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots("b", 6, hits)
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    assert not kv.allocate_slots("c", 4)  # pool exhausted: refused without side effects
    assert "c" not in kv.req
    kv.free("a")
    kv.free("b")
    assert kv.num_allocated_blocks == 0 and kv.pool.num_free == 4
    # freed blocks keep their hashes until evicted; the tails (freed first) are evicted first
    assert len(kv.pool.cached) == 2
    assert kv.allocate_slots("d", 4)
    assert len(kv.pool.cached) == 2  # the two uncached tail blocks were taken, not the cached prefix
    assert kv.allocate_slots("e", 4)  # now the cached ones must go
    assert len(kv.pool.cached) == 0
    # the chain: the same block content after a different parent hashes differently
    assert hash_block(hash_block(None, [1, 2]), [3, 4]) != hash_block(hash_block(None, [0, 2]), [3, 4])


def _req(rid, n_prompt, max_tokens=4):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _run(sched, out, token=7):
    sched.update_from_output(out, {s.request.request_id: StepResult(sampled=[token] if s.samples else [])
                                   for s in out.scheduled})


def test_token_budget_chunked_prefill_and_decodes_share_a_step():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8), kv)
    sched.add_request(_req("a", 3))
    sched.add_request(_req("b", 20))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3), ("b", 7)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    _run(sched, out)
    out = sched.schedule()  # a decodes (running first), b's prompt continues in the rest of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    _run(sched, out)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 4)]
    assert out.scheduled[1].samples


def test_max_num_seqs_and_fcfs():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2), kv)
    for i in range(4):
        sched.add_request(_req(f"r{i}", 2 + i))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    for _ in range(4):
        _run(sched, out)
        out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r2", "r3"]  # r0, r1 finished after 4 tokens


def test_preemption_by_recompute_frees_the_latest_arrival():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), kv)
    sched.add_request(_req("old", 4, max_tokens=4))
    sched.add_request(_req("new", 4, max_tokens=4))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and kv.pool.num_free == 0
    _run(sched, out)
    out = sched.schedule()  # both need a third block: the newest gives way
    assert out.preempted == ["new"]
    assert [s.request.request_id for s in out.scheduled] == ["old"]
    new = sched.requests["new"]
    assert new.num_computed_tokens == 0 and new.output_token_ids == [7] and sched.waiting[0] is new
    while sched.requests.get("old"):
        _run(sched, out)
        out = sched.schedule()
    # the preempted request comes back and recomputes its prompt and its output so far
    assert out.scheduled[0].request is new and out.scheduled[0].num_new_tokens == 5


def test_spec_tokens_are_budgeted_and_rejected_ones_uncomputed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, num_lookahead_tokens=3), kv)
    sched.add_request(_req("a", 5, max_tokens=10))
    out = sched.schedule()
    _run(sched, out)
    req = sched.requests["a"]
    req.spec_token_ids = [8, 9, 10]
    out = sched.schedule()
    s = out.scheduled[0]
    assert s.num_new_tokens == 4 and s.spec_token_ids == [8, 9, 10]
    # the target accepted 8, rejected 9 and sampled 11 instead
    sched.update_from_output(out, {"a": StepResult(sampled=[8, 11])})
    assert req.output_token_ids == [7, 8, 11]
    assert req.num_computed_tokens == req.num_tokens - 1
