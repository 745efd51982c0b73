"""The sampler's processors against the same rules written out token by token (vLLM's definitions:
vllm/model_executor/layers/utils.py apply_penalties, the min_tokens and logit_bias processors, and
min_p after temperature), each row with its own request's params."""

from __future__ import annotations

import pytest
import torch

from stages.serve.sampling import (Sampler, SamplingParams, TokenHistory, apply_logits_processors,
                                   processed_probs)


def _by_hand(row: list[float], p: SamplingParams, h: TokenHistory) -> list[float]:
    x = list(row)
    if len(h.output_token_ids) < p.min_tokens:
        for t in h.stop_token_ids:
            x[t] = float("-inf")
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(h.prompt_token_ids) | set(h.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(h.output_token_ids):
        x[t] -= p.frequency_penalty * h.output_token_ids.count(t) + p.presence_penalty
    return x


def test_processors_match_the_rules_written_out_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0),  # untouched
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3, max_tokens=8),
        SamplingParams(repetition_penalty=0.7, logit_bias={3: 5.0, 7: -100.0}, max_tokens=8),
        SamplingParams(min_tokens=4, logit_bias={9: 2.0}, max_tokens=8),
    ]
    hist = [None,
            TokenHistory([1, 2, 3, 3], [4, 4, 5, 1], frozenset({0})),
            TokenHistory([7, 8], [8, 9, 9, 9], frozenset({0})),
            TokenHistory([5], [6, 6], frozenset({0, 11}))]
    got = apply_logits_processors(logits, params, hist)
    assert torch.equal(got[0], logits[0])
    for i in range(1, 4):
        want = torch.tensor(_by_hand(logits[i].tolist(), params[i], hist[i]))
        assert torch.allclose(got[i], want, atol=1e-5, rtol=0), i
    assert got[3, 0] == got[3, 11] == float("-inf")  # 2 tokens out of min_tokens=4: no stopping yet
    # the Sampler applies them before the argmax, per row
    toks = Sampler()(logits, [SamplingParams(temperature=0.0, **{k: getattr(p, k) for k in (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "max_tokens")})
        for p in params], [None] * 4, hist)
    assert toks == got.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g) * 2
    p = SamplingParams(temperature=temperature, min_p=0.2)
    probs = processed_probs(logits, p)
    base = torch.softmax(logits / temperature, -1)
    keep = base >= 0.2 * base.max(-1, keepdim=True).values
    assert torch.equal(probs > 0, keep)
    want = torch.where(keep, base, torch.zeros_like(base))
    assert torch.allclose(probs, want / want.sum(-1, keepdim=True), atol=1e-6)


def test_sampling_params_refuse_out_of_range_values():
    for bad, needle in ((dict(min_p=1.5), "min_p"), (dict(presence_penalty=-3), "presence_penalty"),
                        (dict(repetition_penalty=0.0), "repetition_penalty"),
                        (dict(min_tokens=5, max_tokens=2), "min_tokens")):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**bad)
