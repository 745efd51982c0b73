"""Decode slots (contiguous K/V rows read in place by decode attention) change no output, whatever
happens to the rows: preemption, finishing and reuse, moves into holes, growth; and stream_interval only regroups
what is streamed, never what is generated."""

from __future__ import annotations

import random

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # a one-token prompt decodes from its very first step; shared prefixes exercise prefix hits
    shared = [rng.randrange(4, 1000) for _ in range(20)]
    out = [[rng.randrange(4, 1000)]]
    for i in range(1, n):
        own = [rng.randrange(4, 1000) for _ in range(rng.randint(3, 40))]
        out.append(shared + own if i % 3 == 0 else own)
    return out


def test_decode_slots_give_the_same_tokens_with_preemption_and_reuse(tiny_hf_model_dir):
    # 4 rows for 10 requests: rows are freed and reused; a 12-block pool forces preemption by recompute
    cfg = dict(num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=48)
    with_slots = LLMEngine(tiny_hf_model_dir, EngineConfig(decode_slots=True, **cfg))
    with_slots.runner.slots.initial_capacity = 16
    prompts = _prompts(10)
    params = [SamplingParams(max_tokens=24 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    got = [o.token_ids for o in with_slots.generate(prompts, params)]
    assert with_slots.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert with_slots.runner.slots.capacity > 16
    assert with_slots.runner.slots.num_moves > 0, "requests finishing below running ones were meant to leave holes"
    assert with_slots.kv.num_allocated_blocks == 0
    plain = LLMEngine(tiny_hf_model_dir, EngineConfig(decode_slots=False, **cfg))
    assert plain.runner.slots is None
    assert got == [o.token_ids for o in plain.generate(prompts, params)]


def test_decode_slots_with_prefix_caching_and_aborts(tiny_hf_model_dir):
    prompts = _prompts(8, seed=1)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = {}
    for slots in (True, False):
        eng = LLMEngine(tiny_hf_model_dir, EngineConfig(decode_slots=slots, num_kv_blocks=96, max_num_seqs=6))
        for i, p in enumerate(prompts):
            eng.add_request(p, params, request_id=f"r{i}")
        final = {}
        for step in range(200):
            if not eng.has_unfinished():
                break
            if step == 5:  # two requests go away while decoding: their rows must be dropped, not reused stale
                assert not slots or {"r1", "r4"} <= set(eng.runner.slots.slot_of)
                eng.abort_request("r1")
                eng.abort_request("r4")
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o.token_ids
        outs[slots] = final
        assert eng.kv.num_allocated_blocks == 0
        if slots:
            eng.runner.slots.release_stale()  # finished and aborted requests no longer hold rows
            assert eng.runner.slots.num_used == 0 and all(o is None for o in eng.runner.slots.owner)
    assert set(outs[True]) == {f"r{i}" for i in range(8)} - {"r1", "r4"}
    assert outs[True] == outs[False]


def test_stream_interval_regroups_deltas_only(tiny_hf_model_dir):
    prompts = _prompts(4, seed=2)
    params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)
    streams = {}
    for interval in (1, 4):
        eng = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=96, stream_interval=interval))
        ids = [eng.add_request(p, params) for p in prompts]
        deltas: dict[str, list[list[int]]] = {i: [] for i in ids}
        text: dict[str, str] = {i: "" for i in ids}
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                deltas[o.request_id].append(o.delta_token_ids)
                text[o.request_id] += o.delta_text
                if o.finished:
                    final[o.request_id] = o
        for i in ids:
            d = deltas[i]
            assert [t for x in d for t in x] == final[i].token_ids  # nothing lost, nothing twice
            assert text[i] == final[i].text
            assert len(d[0]) == 1  # the first token is handed out at once
            assert all(len(x) == interval for x in d[1:-1])  # then `interval` at a time, the rest at the end
            assert 1 <= len(d[-1]) <= interval
        streams[interval] = [final[i].token_ids for i in ids]
    assert streams[1] == streams[4]
