"""Prefill/decode disaggregation: K/V shipped as bytes from a prefill engine into a decode engine's
prefix cache gives the same outputs as one engine, with only each prompt's tail computed on the
decode side; payloads round-trip bit-exactly and are refused by engines they do not fit."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from stages.serve.async_engine import AsyncEngine
from stages.serve.disagg import DisaggregatedEngine, prefill_engine_config
from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.kv_transfer import KVPayload, KVTransferError, export_kv, import_kv, read_blocks
from stages.serve.metrics import ServeMetrics
from stages.serve.sampling import SamplingParams

BS = 8


@pytest.fixture(scope="module")
def other_shape_dir(tmp_path_factory):
    from stages.serve.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("other") / "two-layers", num_layers=2, hidden_size=64)


def _engines(model_dir, num_blocks=64, **options):
    metrics = ServeMetrics()
    cfg = EngineConfig(block_size=BS, num_kv_blocks=num_blocks, **options)
    dec = LLMEngine(model_dir, cfg, metrics=metrics)
    pre = LLMEngine(model_dir, prefill_engine_config(cfg, dec.model_name), tokenizer=dec.tokenizer, metrics=metrics)
    return pre, dec, metrics


def _prompts():
    # distinct contents (no shared prefixes); lengths: shorter than a block, exactly one and two
    # blocks, and ragged ones
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, BS, 2 * BS, 2 * BS + 5, 3 * BS + 7)]


async def _collect(front, prompt, params, stop_after=None):
    outs = []
    async for o in front.generate(prompt, params):
        outs.append(o)
        if stop_after is not None and len(outs) >= stop_after:
            break  # the client leaves: the request is aborted
    return outs


def _first_chunks(engine):
    """Record, per request, where its first scheduled chunk on `engine` starts (= prompt tokens it
    did not compute) and how many tokens that chunk fed."""
    seen: dict[str, tuple[int, int]] = {}
    execute = engine.runner.execute

    def spy(sched):
        for s in sched.scheduled:
            seen.setdefault(s.request.request_id, (s.start, s.num_new_tokens))
        return execute(sched)

    engine.runner.execute = spy
    return seen


def _no_leaks(*engines):
    for e in engines:
        assert e.kv.num_allocated_blocks == 0, e.model_name
        assert not e.held_kv and not e.kv.req and not e.has_unfinished(), e.model_name


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_disaggregated_outputs_match_one_engine_and_decode_computes_only_the_tail(tiny_hf_model_dir, kv_cache_dtype):
    pre, dec, metrics = _engines(tiny_hf_model_dir, kv_cache_dtype=kv_cache_dtype)
    ref = LLMEngine(tiny_hf_model_dir, EngineConfig(block_size=BS, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype),
                    tokenizer=dec.tokenizer)
    prompts = _prompts()
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) for _ in prompts]
    # a seeded sampled request: its generator's state travels with the K/V
    params[3] = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    want = ref.generate(prompts, params)

    front = DisaggregatedEngine([AsyncEngine(pre)], [AsyncEngine(dec)])
    first_chunks = _first_chunks(dec)

    async def run():
        return await asyncio.gather(*[_collect(front, p, sp) for p, sp in zip(prompts, params)])

    streams = asyncio.run(run())
    front.shutdown()  # the engines' threads finish what was handed to them: the engines are the test's again
    for prompt, w, outs in zip(prompts, want, streams):
        got = outs[-1]
        assert got.finished and got.token_ids == w.token_ids and got.text == w.text
        assert "".join(o.delta_text for o in outs) == w.text  # the stream adds up, first token included
        assert [t for o in outs for t in o.delta_token_ids] == w.token_ids
        n = len(prompt)
        assert got.num_cached_tokens == n // BS * BS  # every full prompt block came over
        start, fed = first_chunks[got.request_id]
        assert start == n // BS * BS and n - start < BS  # the decode engine computed only the tail
        assert fed == n - start + 1  # ... and the first token, sampled on the prefill engine
    full = sum(len(p) // BS for p in prompts)
    assert front.stats.num_transfers == len(prompts) and front.stats.num_blocks == full
    assert dec.kv.stats.hits == full * BS
    assert pre.kv.stats.hits == 0  # distinct prompts: the prefill engine computed them all
    name = dec.model_name
    per_token = dec.kv_bytes_per_token  # the payload is the shipped blocks' K/V (and FP8 scales) plus a small header
    assert full * BS * per_token < metrics.kv_transfer_bytes.value(model_name=name) == front.stats.num_bytes
    assert front.stats.num_bytes < full * BS * per_token + len(prompts) * 8192
    assert metrics.kv_transfer_time.count(model_name=name) == len(prompts)
    assert metrics.requests.value(model_name=name, finished_reason="length") == len(prompts)
    assert metrics.ttft.count(model_name=name) == metrics.e2e.count(model_name=name) == len(prompts)
    _no_leaks(pre, dec)


def test_payload_round_trips_bit_exactly(tiny_hf_model_dir):
    pre, dec, _ = _engines(tiny_hf_model_dir)
    prompt = _prompts()[-1]  # 3 full blocks + 7
    sp = SamplingParams(max_tokens=1, temperature=0.8, seed=3, logprobs=2)
    rid = pre.add_request(prompt, sp, hold_kv=True)
    while pre.has_unfinished():
        pre.step()
    held = pre.held_kv[rid]
    assert len(held.blocks) == 3 and pre.kv.num_allocated_blocks == 3  # kept past the finish
    want_kv, _ = read_blocks(pre, [b.block_id for b in held.blocks])
    payload = export_kv(pre, rid)
    assert pre.kv.num_allocated_blocks == 0 and not pre.held_kv  # released by the export
    data = payload.to_bytes()
    back = KVPayload.from_bytes(data)
    assert back.header == payload.header and torch.equal(back.kv, want_kv) and back.kv.dtype == want_kv.dtype
    assert torch.equal(back.generator_state, payload.generator_state)
    pf = back.prefilled()
    assert pf.output_token_ids == held.request.output_token_ids and pf.logprobs == held.request.logprobs

    res = import_kv(dec, back)
    assert (res.num_blocks, res.num_imported, res.num_already_cached) == (3, 3, 0)
    assert dec.kv.num_allocated_blocks == 0  # cached, unreferenced, evictable
    got_blocks = [dec.kv.pool.lookup(h) for h in back.block_hashes]
    assert all(b is not None and b.ref_cnt == 0 for b in got_blocks)
    got_kv, _ = read_blocks(dec, [b.block_id for b in got_blocks])
    assert torch.equal(got_kv, want_kv)  # bit-exact in the decode engine's own pool
    # the prefix lookup a request makes finds them
    hits, n = dec.kv.get_computed_blocks("x", prompt + [1])
    assert n == 3 * BS and hits == got_blocks
    again = import_kv(dec, KVPayload.from_bytes(data))  # idempotent: nothing written twice
    assert (again.num_imported, again.num_already_cached) == (0, 3)
    # a pool with room for two: the leading blocks are taken, the rest recomputed when needed
    small = LLMEngine(tiny_hf_model_dir, EngineConfig(block_size=BS, num_kv_blocks=4), tokenizer=dec.tokenizer)
    assert small.kv.allocate_slots("busy", 2 * BS)
    part = import_kv(small, KVPayload.from_bytes(data))
    assert (part.num_imported, part.num_already_cached) == (2, 0)
    assert small.kv.get_computed_blocks("x", prompt + [1])[1] == 2 * BS
    small.kv.free("busy")
    _no_leaks(pre, dec, small)


def test_payload_that_does_not_fit_is_refused(tiny_hf_model_dir, other_shape_dir):
    pre, dec, _ = _engines(tiny_hf_model_dir)
    rid = pre.add_request(_prompts()[2], SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while pre.has_unfinished():
        pre.step()
    data = export_kv(pre, rid).to_bytes()
    other_block = LLMEngine(tiny_hf_model_dir, EngineConfig(block_size=2 * BS, num_kv_blocks=16),
                            tokenizer=dec.tokenizer)
    with pytest.raises(KVTransferError, match=r"block_size 8 \(payload\) != 16"):
        import_kv(other_block, KVPayload.from_bytes(data))
    other_model = LLMEngine(other_shape_dir, EngineConfig(block_size=BS, num_kv_blocks=16))
    with pytest.raises(KVTransferError, match=r"num_layers 4 \(payload\) != 2.*head_dim.*weights"):
        import_kv(other_model, KVPayload.from_bytes(data))
    bf16 = LLMEngine(tiny_hf_model_dir, EngineConfig(block_size=BS, num_kv_blocks=16, dtype="bfloat16"),
                     tokenizer=dec.tokenizer)
    with pytest.raises(KVTransferError, match=r"dtype 'float32' \(payload\) != 'bfloat16'"):
        import_kv(bf16, KVPayload.from_bytes(data))
    # after a weight update the old K/V are stale
    from stages.serve.model import load_hf_state_dict

    dec.update_weights(load_hf_state_dict(tiny_hf_model_dir))
    with pytest.raises(KVTransferError, match=r"weights .*\+v0.*\+v1"):
        import_kv(dec, KVPayload.from_bytes(data))
    with pytest.raises(KVTransferError, match="not an eightfold KV payload"):
        KVPayload.from_bytes(data[:8] + b"{}" + data[10:])
    with pytest.raises(KVTransferError, match="cannot exchange K/V"):
        DisaggregatedEngine([AsyncEngine(pre)], [AsyncEngine(other_block)])
    for e in (other_block, other_model, bf16, dec):
        assert e.kv.num_allocated_blocks == 0 and not e.kv.pool.cached


def test_aborted_and_finished_requests_leak_no_blocks(tiny_hf_model_dir):
    pre, dec, metrics = _engines(tiny_hf_model_dir, num_blocks=24)
    front = DisaggregatedEngine([AsyncEngine(pre)], [AsyncEngine(dec)])
    prompts = _prompts()
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(tiny_hf_model_dir, EngineConfig(block_size=BS, num_kv_blocks=24), tokenizer=dec.tokenizer)
    w = ref.generate([prompts[4]], long)[0]
    # ends on the prefill engine (a stop token first), or on the decode engine at once (a stop
    # string inside the first token's text), or later (a stop string further on)
    early = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[w.token_ids[0]]),
             SamplingParams(max_tokens=12, temperature=0.0, stop=[ref._decode(w.token_ids[:1])[-1]]),
             SamplingParams(max_tokens=12, temperature=0.0, stop=[w.text[-3:]])]
    want = ref.generate([prompts[4]] * 3, early)

    async def run():
        jobs = [_collect(front, p, long, stop_after=2 if i % 2 else None) for i, p in enumerate(prompts)]
        jobs.append(_collect(front, prompts[0], SamplingParams(max_tokens=1, temperature=0.0)))  # one token
        jobs += [_collect(front, prompts[4], sp) for sp in early]
        return await asyncio.gather(*jobs)

    streams = asyncio.run(run())
    front.shutdown()  # the aborts of the requests left early are run: the engines are the test's again
    assert [s[-1].finished for s in streams] == [True, False, True, False, True, True, True, True, True]
    assert [len(s[-1].token_ids) for s in streams[:6] if s[-1].finished] == [12, 12, 12, 1]
    for wo, s in zip(want, streams[6:]):
        assert (s[-1].token_ids, s[-1].text, s[-1].finish_reason) == (wo.token_ids, wo.text, wo.finish_reason)
    assert [wo.finish_reason for wo in want] == ["stop"] * 3
    assert [len(wo.token_ids) for wo in want[:2]] == [1, 1] and len(want[2].token_ids) > 2
    assert front.stats.num_transfers == 5 + 2  # not the one-token request, nor the one ended by the prefill
    assert metrics.requests.value(model_name=dec.model_name, finished_reason="abort") == 2  # left on the decode engine
    # a request aborted before its prefill finishes: nothing is held for it
    rid = pre.add_request(prompts[-1], SamplingParams(max_tokens=1), hold_kv=True)
    assert pre.abort_request(rid)
    while pre.has_unfinished():
        pre.step()
    assert not pre.held_kv
    rid = pre.add_request(prompts[-1], SamplingParams(max_tokens=1), hold_kv=True)
    while pre.has_unfinished():
        pre.step()
    assert pre.held_kv and pre.abort_request(rid) is False  # already finished, but its hold goes
    _no_leaks(pre, dec)
    assert front.load == 0


def test_stream_keeps_its_order_when_the_loop_resumes_late(tiny_hf_model_dir):
    """The decode engine's first output (the prefill's token) comes before its steps' outputs even when
    the event loop is busy while the engine thread already steps: on a loaded server, that first output
    was queued last and the stream came out shuffled."""
    import threading
    import time

    pre, dec, _ = _engines(tiny_hf_model_dir)
    ref = LLMEngine(tiny_hf_model_dir, EngineConfig(block_size=BS, num_kv_blocks=64), tokenizer=dec.tokenizer)
    prompt, params = _prompts()[3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = ref.generate([prompt], params)[0]
    decode = AsyncEngine(dec)
    front = DisaggregatedEngine([AsyncEngine(pre)], [decode])
    handed_over = decode.call

    async def late_call(fn):
        added = threading.Event()

        def add(engine):
            try:
                return fn(engine)
            finally:
                added.set()

        pending = asyncio.ensure_future(handed_over(add))
        await asyncio.sleep(0)  # handed to the engine thread
        # the loop is busy elsewhere while the engine thread adds the request and runs it to its end
        assert added.wait(60)
        deadline = time.monotonic() + 60
        while dec.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not dec.has_unfinished()
        return await pending

    decode.call = late_call
    outs = asyncio.run(_collect(front, prompt, params))
    front.shutdown()
    assert len(outs) > 2  # every step's output, each queued before the loop resumed
    assert [t for o in outs for t in o.delta_token_ids] == want.token_ids
    assert "".join(o.delta_text for o in outs) == want.text
    _no_leaks(pre, dec)


def test_router_serves_through_the_disaggregated_replica(tiny_hf_model_dir):
    from stages.serve.server import ServerThread, build_app, build_router

    router = build_router(str(tiny_hf_model_dir), replicas=1, prefill_replicas=1, num_kv_blocks=64, block_size=BS)
    front = router.primary
    assert isinstance(front, DisaggregatedEngine)
    ref = LLMEngine(tiny_hf_model_dir, EngineConfig(block_size=BS, num_kv_blocks=64), tokenizer=front.engine.tokenizer)
    prompt = "def fibonacci(n):\n    return"
    want = ref.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    with ServerThread(build_app(router)) as srv:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as s:
            import json

            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        text = httpx.get(srv.url + "/metrics").text
    router.shutdown()
    assert front.stats.num_transfers == 2

    def total(sample: str) -> float:  # summed over the decode engines (the `engine` label)
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(sample + "{") and f'model_name="{front.model_name}"' in line)

    assert total("eightfold:kv_transfer_bytes_total") == float(front.stats.num_bytes)
    assert total("eightfold:kv_transfer_seconds_count") == 2
    _no_leaks(*(e.engine for e in front.engines))
