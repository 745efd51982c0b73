"""Speculative decoding: greedy output identical to plain decoding with both proposers, and exact
rejection sampling that leaves the target distribution unchanged (chi-square)."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams
from stages.serve.speculative import NgramProposer, rejection_sample

CODE = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "x = 1\ny = 2\n",
]


@pytest.fixture(scope="module")
def plain(tiny_hf_model_dir):
    return LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=128))


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_greedy_equals_plain(kind, plain, tiny_hf_model_dir, tiny_hf_draft_dir):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(CODE, params)]
    spec = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=128, speculative=kind, num_speculative_tokens=4,
                                                     draft_model_dir=str(tiny_hf_draft_dir)))
    got = [o.token_ids for o in spec.generate(CODE, params)]
    assert got == want
    proposed = spec.metrics.spec_proposed.value(model_name=spec.model_name)
    accepted = spec.metrics.spec_accepted.value(model_name=spec.model_name)
    assert proposed > 0 and 0 < accepted <= proposed
    # Fewer target forwards than tokens, as a mechanism: one request alone takes one forward per token it
    # did not get from an accepted draft (a batch takes its slowest request's count, so "fewer steps than
    # plain" needed every request to accept a draft: measured over checkpoint seeds 0..7 the n-gram batch
    # took 33..47 steps of 48, a 1-step margin at seed 7).
    assert spec.num_steps <= plain.num_steps
    alone = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=128, speculative=kind, num_speculative_tokens=4,
                                                      draft_model_dir=str(tiny_hf_draft_dir)))
    assert alone.generate(CODE[:1], params)[0].token_ids == want[0]
    accepted_alone = alone.metrics.spec_accepted.value(model_name=alone.model_name)
    assert alone.num_steps == params.max_tokens - accepted_alone
    assert spec.kv.num_allocated_blocks == 0


def test_speculative_in_decode_slots_with_preemption_equals_plain(plain, tiny_hf_model_dir):
    """Verification reads the requests' decode slots (k+1 causal rows each, rejected drafts'
    K/V overwritten later); a pool too small for all of them forces preemptions on top."""
    prompts = CODE + [f"def f{i}(x):\n    return x * {i}\n" for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    tight = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=14, enable_prefix_caching=False,
                                                      speculative="ngram", num_speculative_tokens=3))
    assert tight.runner.slots is not None
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0
    assert tight.metrics.spec_accepted.value(model_name=tight.model_name) > 0
    assert got == want
    assert tight.kv.num_allocated_blocks == 0


def test_speculative_sampling_runs_and_respects_max_tokens(tiny_hf_model_dir, tiny_hf_draft_dir):
    spec = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=128, speculative="draft",
                                                     draft_model_dir=str(tiny_hf_draft_dir)))
    outs = spec.generate(CODE, SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 30 for o in outs)
    assert spec.metrics.spec_accepted.value(model_name=spec.model_name) > 0


def test_ngram_proposer_follows_the_continuation_most_matches_agree_on():
    prop = NgramProposer(k=3, n_max=3, n_min=1)
    # one earlier match of [1, 2, 3] was followed by 9, two by 7: 7 wins, from the latest match so followed
    assert prop.propose_one([1, 2, 3, 7, 8, 1, 2, 3, 9, 1, 2, 3, 7, 6, 1, 2, 3], 3) == [7, 6, 1]
    # a tie goes to the latest match
    assert prop.propose_one([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert prop.propose_one([5, 6, 7], 3) == []
    # a loop: the latest match is right behind, and the proposal continues the period
    assert prop.propose_one([4, 4, 4, 4], 3) == [4, 4, 4]
    assert prop.propose_one([9, 1, 2, 1, 2, 1, 2], 3) == [1, 2, 1]
    # against a plain scan, on ids whose bytes also match across token boundaries
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.choice([0, 1, 256, 257, 65536, 2**40]) for _ in range(rng.randint(1, 30))]
        n_min = rng.randint(1, 3)
        p = NgramProposer(k=4, n_max=rng.randint(n_min, 4), n_min=n_min)
        assert p.propose_one(tokens, 4) == _voted_match_scan(tokens, 4, p.n_max, p.n_min, p.MAX_MATCHES), tokens


def _voted_match_scan(tokens, k, n_max, n_min, max_matches):
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        after = [s + n for s in range(L - 1 - n, -1, -1) if tokens[s:s + n] == tokens[L - n:]][:max_matches]
        if after:
            count = {t: sum(tokens[s] == t for s in after) for t in (tokens[s] for s in after)}
            start = next(s for s in after if count[tokens[s]] == max(count.values()))
            out = tokens[start: start + k]
            while len(out) < k:
                out.append(out[len(out) - (L - start)])
            return out
    return []


def _chi2_first_token(p_logits, draft_probs, k, trials, greedy=False, seed=0):
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(seed)
    V = p_logits.shape[-1]
    counts = torch.zeros(V)
    for _ in range(trials):
        if draft_probs is None:  # a deterministic draft (n-gram): always proposes token 0, 1, ...
            drafts = list(range(k))
        else:
            drafts = [int(torch.multinomial(draft_probs[i], 1, generator=g)) for i in range(k)]
        out = rejection_sample(p_logits, drafts, draft_probs, params, g)
        counts[out[0]] += 1
    return counts


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(deterministic_draft):
    torch.manual_seed(0)
    V, k, trials = 6, 2, 6000
    p_logits = torch.randn(k + 1, V) * 1.5
    p = torch.softmax(p_logits, -1)
    q = None if deterministic_draft else torch.softmax(torch.randn(k, V) * 1.5, -1)
    counts = _chi2_first_token(p_logits, q, k, trials)
    expected = p[0] * trials
    stat, pvalue = chisquare(counts.numpy(), expected.numpy())
    assert pvalue > 1e-3, (counts, expected)
    # and the test can fail: the draft's own distribution is rejected
    if q is not None:
        _, p_wrong = chisquare(counts.numpy(), (q[0] * trials).numpy())
        assert p_wrong < 1e-6


def test_rejection_sampling_greedy_accepts_while_argmax_agrees():
    logits = torch.tensor([[0.0, 5.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    params = SamplingParams(temperature=0.0)
    assert rejection_sample(logits, [1, 0], None, params, None) == [1, 0, 2]  # all accepted + bonus
    assert rejection_sample(logits, [1, 2], None, params, None) == [1, 0]  # second rejected, corrected
    assert rejection_sample(logits, [2, 0], None, params, None) == [1]
