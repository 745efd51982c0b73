"""The engine against Hugging Face transformers on the same checkpoint: greedy output, logprobs,
prompt logprobs and loglikelihoods; paged, chunked, prefix-cached and preempted runs against plain ones."""

from __future__ import annotations

import pytest
import torch

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nclass A:",
    "for i in range(10):\n",
    "x",
    # long enough to be split into several prefill chunks by a 32-token budget
    "import sys\nimport json\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n    args = parser.parse_args(argv)\n"
    "    with open(args.path) as f:\n        data = json.load(f)\n    return data\n",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def hf(tiny_hf_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_model_dir)).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_hf_model_dir))


@pytest.fixture(scope="module")
def engine(tiny_hf_model_dir):
    return LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=96, max_num_batched_tokens=32, max_num_seqs=4))


def _hf_greedy(hf, prompt: str, n: int) -> list[int]:
    model, tok = hf
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_equals_hf_generate_with_chunked_prefill_and_continuous_batching(engine, hf):
    outs = engine.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == _hf_greedy(hf, p, GREEDY.max_tokens), p
    # the long prompt really was chunked and requests really shared steps
    assert len(engine.encode(PROMPTS[-1])) > 32
    assert engine.kv.num_allocated_blocks == 0


def test_prefix_cached_equals_uncached(tiny_hf_model_dir, engine):
    system = "You are a careful Python programmer. Answer with code only.\n" * 2
    prompts = [system + q for q in ("def add(a, b):", "class Stack:", "import re\n")]
    plain = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=96, enable_prefix_caching=False))
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    engine.reset_prefix_cache()
    first = engine.generate(prompts[:1], GREEDY)  # fills the cache with the shared prefix
    hits_before = engine.kv.stats.hits
    rest = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in rest] == want
    assert first[0].token_ids == want[0]
    assert engine.kv.stats.hits - hits_before >= 3 * 16  # every prompt reused at least 1 full block
    assert all(o.num_cached_tokens > 0 for o in rest)
    assert plain.kv.stats.hits == 0


def test_preemption_by_recompute_gives_the_same_tokens(tiny_hf_model_dir, engine):
    prompts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(prompts, params)]
    tight = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=10, enable_prefix_caching=False))
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    assert tight.kv.num_allocated_blocks == 0


def test_logprobs_and_prompt_logprobs_match_hf(engine, hf):
    model, tok = hf
    prompt = PROMPTS[0]
    o = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2))[0]
    ids = tok(prompt).input_ids + o.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    n_prompt = len(o.prompt_token_ids)
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == n_prompt
    for p in range(1, len(ids)):
        lp = o.prompt_logprobs[p] if p < n_prompt else o.logprobs[p - n_prompt]
        assert lp.token_id == ids[p]
        assert lp.logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
    top = o.logprobs[0].top
    assert len(top) == 3 and max(top, key=top.get) == o.token_ids[0]


def test_score_matches_hf_loglikelihood(engine, hf):
    model, _ = hf
    ctx, cont = engine.encode("def foo(x):\n"), engine.encode("    return x")
    (total, greedy), = engine.score([(ctx, cont)])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), -1)
    want = sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
    want_greedy = all(lp[len(ctx) - 1 + i].argmax().item() == t for i, t in enumerate(cont))
    assert total == pytest.approx(want, abs=1e-3)
    assert greedy == want_greedy
    # the greedy continuation is greedy by definition
    g = engine.generate([ctx], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids
    assert engine.score([(ctx, g)])[0][1] is True


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    p = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    alone = engine.generate([PROMPTS[0]], p)[0].token_ids
    crowd = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                            [SamplingParams(max_tokens=12, temperature=1.0, seed=1), p,
                             SamplingParams(max_tokens=12, temperature=0.5)])[1].token_ids
    assert alone == crowd
    other = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=8))
    assert other[0].token_ids != alone
    # top_k=1 is greedy whatever the temperature
    k1 = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3))[0]
    assert k1.token_ids == engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids


def test_sampler_batches_rows_and_keeps_seeded_rows_their_own():
    from stages.serve.sampling import Sampler, make_generator, sample_rows

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=0.9, seed=11)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1), seeded,
              SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, top_p=1e-6)]
    gens = [make_generator(p) for p in params]
    got = Sampler()(logits, params, gens)
    best = logits.argmax(dim=-1).tolist()
    # greedy rows, and unseeded rows whose distribution keeps one token (grouped by params), are the argmax
    assert [got[i] for i in (0, 1, 3, 4, 5)] == [best[i] for i in (0, 1, 3, 4, 5)]
    # a seeded row draws from its own generator, as it would alone
    assert got[2] == int(sample_rows(logits[2:3], seeded, make_generator(seeded))[0])


def test_stop_strings_tokens_and_max_tokens(engine):
    base = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    stop = base.text[5:8]
    o = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]))[0]
    assert o.finish_reason == "stop" and o.text == base.text[: base.text.find(stop)]
    t = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0,
                                                     stop_token_ids=[base.token_ids[3]]))[0]
    assert t.finish_reason == "stop" and t.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[3]) + 1]


def test_fp8_kv_cache_stays_close(tiny_hf_model_dir, engine):
    fp8 = LLMEngine(tiny_hf_model_dir, EngineConfig(kv_cache_dtype="fp8", kv_cache_memory_gb=0.01))
    full = LLMEngine(tiny_hf_model_dir, EngineConfig(kv_cache_memory_gb=0.01))
    assert fp8.kv_bytes_per_token < full.kv_bytes_per_token / 2 * 1.3
    assert fp8.kv.pool.num_blocks > full.kv.pool.num_blocks * 1.5
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    a = fp8.generate(PROMPTS, p)
    b = full.generate(PROMPTS, p)
    diffs = [abs(x.logprob - y.logprob) for oa, ob in zip(a, b) for x, y in zip(oa.prompt_logprobs[1:], ob.prompt_logprobs[1:])]
    assert max(diffs) < 0.05
    assert max(diffs) > 0  # it really was quantised


def test_update_weights_resets_prefix_cache_and_matches_hf(tiny_hf_model_dir, hf):
    from transformers import AutoModelForCausalLM

    eng = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=64))
    prompt = PROMPTS[-1]
    eng.generate([prompt], GREEDY)
    assert eng.kv.pool.cached
    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_model_dir)).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    eng.update_weights(model.state_dict())
    assert not eng.kv.pool.cached
    got = eng.generate([prompt], GREEDY)[0].token_ids
    ids = hf[1](prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    assert got == want


def test_bad_input_is_named(engine, tiny_hf_model_dir):
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("x", SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([10**7], SamplingParams())
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_options(block_sise=16)
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLMEngine(tiny_hf_model_dir.parent, EngineConfig())


def test_fp8_weight_checkpoint_loads_and_stays_close(tiny_hf_model_dir, engine, tmp_path):
    """An FP8 (e4m3) weight variant with per-channel `weight_scale` tensors, as an export stage may write."""
    import shutil

    from safetensors.torch import load_file, save_file

    for f in tiny_hf_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    sd = load_file(str(next(tiny_hf_model_dir.glob("*.safetensors"))))
    q = {}
    for name, w in sd.items():
        if w.dim() == 2 and "embed" not in name:
            scale = (w.abs().amax(dim=1) / 448.0).clamp_min(1e-12)
            q[name] = (w / scale[:, None]).to(torch.float8_e4m3fn)
            q[name[: -len(".weight")] + ".weight_scale"] = scale
        else:
            q[name] = w
    save_file(q, str(tmp_path / "model.safetensors"))
    fp8 = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64))
    assert fp8.model.layers[0]["qkv"].dtype == torch.float32
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    a, b = fp8.generate(PROMPTS[:3], p), engine.generate(PROMPTS[:3], p)
    diffs = [abs(x.logprob - y.logprob) for oa, ob in zip(a, b) for x, y in zip(oa.prompt_logprobs[1:], ob.prompt_logprobs[1:])]
    assert 0 < max(diffs) < 0.1
