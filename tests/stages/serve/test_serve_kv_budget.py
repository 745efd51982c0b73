"""The KV budget pays for the paged pool and the decode slots together (kv_budget.py): whatever the
load, the bytes of the pool's tensors and of the slots' rows stay within kv_cache_memory_gb, rows
capped by it hand long contexts to the pool without changing a token, and a budget that cannot hold
one max_model_len request fails at start with the numbers and the knobs."""

from __future__ import annotations

import random

import pytest

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.kv_budget import MIN_SLOT_ROW, plan_kv_budget, slot_bytes
from stages.serve.sampling import SamplingParams

GiB = 2**30


def _pool_nbytes(engine: LLMEngine) -> int:
    cache = engine.cache
    return sum(t.nbytes for t in cache.kv) + (sum(t.nbytes for t in cache.scale) if cache.fp8 else 0)


@pytest.mark.parametrize("budget_gb,num_slots,max_len", [
    (0.25, 64, 2048), (0.25, 128, 2048), (0.05, 256, 256), (0.0015, 4, 256), (0.001, 8, 256), (1.0, 64, 4096),
])
def test_plan_fits_the_budget_and_keeps_one_whole_request(budget_gb, num_slots, max_len):
    budget, bpt, layers = int(budget_gb * GiB), 2048, 4
    p = plan_kv_budget(budget, block_size=16, pool_bytes_per_token=bpt, max_model_len=max_len,
                       num_slots=num_slots, slot_bytes_per_token=bpt, num_layers=layers)
    assert p.pool_bytes + p.slot_bytes <= budget
    assert p.pool_bytes == p.num_blocks * 16 * bpt
    assert p.num_blocks * 16 >= max_len  # one max_model_len request fits the pool
    if p.slot_row_capacity is None:
        assert p.slot_bytes == 0
    else:
        assert MIN_SLOT_ROW <= p.slot_row_capacity <= max_len + 1
        assert p.slot_bytes >= num_slots * p.slot_row_capacity * bpt
        # capped rows hold no more tokens than the pool (module docstring's rule)
        assert p.slot_row_capacity == max_len + 1 or num_slots * p.slot_row_capacity <= p.num_blocks * 16


def test_growth_reservation_counts_the_old_layer():
    # rows doubling 256 -> 512 -> 1024: the last growth keeps one layer at 512 beside the 4 new ones
    assert slot_bytes(2, 1024, 4, 100, 256) == 2 * 1024 * 100 + 2 * 512 * 100 // 4
    assert slot_bytes(2, 200, 4, 100, 256) == 2 * 200 * 100  # born at its full size: no growth


def test_pool_and_grown_slots_stay_within_the_budget_and_change_no_token(tiny_hf_model_dir):
    """Rows capped at ~100 tokens by a small budget; prompts + outputs run to ~170 tokens, so rows
    grow to their cap, requests then decode from the pool, and the pool preempts."""
    budget_gb = 0.0015
    cfg = dict(kv_cache_memory_gb=budget_gb, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64)
    eng = LLMEngine(tiny_hf_model_dir, EngineConfig(**cfg))
    slots = eng.runner.slots
    assert slots is not None
    cap = slots.row_capacity
    assert cap == eng.kv_budget.slot_row_capacity and MIN_SLOT_ROW <= cap < 170
    slots.initial_capacity = 32  # grow in several steps, as longer contexts would from 256
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=130, temperature=0.0, ignore_eos=True)
    seen_max = 0
    reqs = [eng.add_request(p, params) for p in prompts]
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.token_ids
        seen_max = max(seen_max, _pool_nbytes(eng) + slots.nbytes)
    assert slots.capacity == cap, "the load was meant to grow the rows to their cap"
    assert eng.scheduler.num_preemptions > 0, "the pool was meant to be tight enough to preempt"
    budget = int(budget_gb * GiB)
    assert _pool_nbytes(eng) == eng.kv_budget.pool_bytes
    assert seen_max <= budget, f"pool + slots reached {seen_max} bytes, budget {budget}"
    assert _pool_nbytes(eng) + slots.nbytes <= eng.kv_budget.pool_bytes + eng.kv_budget.slot_bytes <= budget
    plain = LLMEngine(tiny_hf_model_dir, EngineConfig(**cfg, decode_slots=False))
    assert plain.runner.slots is None and plain.kv_budget.slot_bytes == 0
    assert plain.kv.pool.num_blocks > eng.kv.pool.num_blocks  # without rows the pool gets the whole budget
    assert [final[r] for r in reqs] == [o.token_ids for o in plain.generate(prompts, params)]


def test_a_budget_without_room_for_one_request_fails_at_start(tiny_hf_model_dir):
    with pytest.raises(ValueError) as e:
        LLMEngine(tiny_hf_model_dir, EngineConfig(kv_cache_memory_gb=0.001, max_model_len=2048))
    msg = str(e.value)
    # 0.001 GiB = 1073741 bytes; one 2048-token request needs 128 blocks x 16 x 2048 = 4194304 bytes
    for part in ("kv_cache_memory_gb=0.001", "1073741 bytes", "max_model_len=2048", "4194304 bytes",
                 "max_num_seqs=64"):
        assert part in msg, (part, msg)


def test_a_tight_budget_turns_the_slots_off_rather_than_starve_the_pool(tiny_hf_model_dir):
    # 0.0011 GiB holds ~576 tokens: rows for 64 sequences would get ~4 tokens each
    eng = LLMEngine(tiny_hf_model_dir, EngineConfig(kv_cache_memory_gb=0.0011, max_model_len=256))
    assert eng.runner.slots is None and eng.kv_budget.slot_bytes == 0
    assert eng.kv.pool.num_blocks == int(0.0011 * GiB) // (16 * eng.kv_bytes_per_token)
