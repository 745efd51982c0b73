"""PPO's pieces (trainer/objectives/ppo.py) against their definitions computed another way: GAE as the explicit
discounted sum of TD errors, rewards as the KL penalty plus the score on the last token, whitening's moments,
the clipped losses at hand-picked ratios, the adaptive KL controller's update, and the loss of a whole
PolicyAndValue step."""

import math

import pytest
import torch

from fixtures.trainer_data import tiny_config
from trainer.loss import IGNORE_INDEX
from trainer.model import Transformer
from trainer.objectives.ppo import (AdaptiveKL, PolicyAndValue, PPOBatch, ProximalPolicy, gae, masked_whiten,
                                    per_token_rewards, ppo_token_losses, token_logps)
from trainer.objectives.reward import RewardModel


def _mask(spans, S):
    m = torch.zeros(len(spans), S, dtype=torch.bool)
    for i, (a, b) in enumerate(spans):
        m[i, a:b] = True
    return m


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_gae_is_the_discounted_sum_of_td_errors(gamma, lam):
    g = torch.Generator().manual_seed(0)
    S, spans = 9, [(2, 7), (0, 9), (4, 5)]
    mask = _mask(spans, S)
    rewards, values = torch.randn(3, S, generator=g) * mask, torch.randn(3, S, generator=g) * mask
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i, (a, b) in enumerate(spans):
        r, v = rewards[i, a:b].tolist(), values[i, a:b].tolist() + [0.0]  # the episode ends after the last token
        delta = [r[t] + gamma * v[t + 1] - v[t] for t in range(b - a)]
        for t in range(b - a):
            want = sum((gamma * lam) ** k * delta[t + k] for k in range(b - a - t))
            assert adv[i, a + t].item() == pytest.approx(want, abs=1e-5)
            assert ret[i, a + t].item() == pytest.approx(want + v[t], abs=1e-5)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_rewards_are_the_kl_penalty_plus_the_score_on_the_last_token():
    mask = _mask([(1, 4), (0, 2)], 5)
    logps, ref = -torch.rand(2, 5), -torch.rand(2, 5)
    rewards, kl = per_token_rewards(torch.tensor([2.0, -1.0]), logps, ref, mask, kl_coef=0.1)
    want = -0.1 * (logps - ref) * mask
    want[0, 3] += 2.0
    want[1, 1] += -1.0
    assert torch.allclose(rewards, want) and torch.allclose(kl, (logps - ref) * mask)


def test_whitening_has_zero_mean_and_unit_unbiased_variance_on_the_mask():
    x = torch.randn(4, 6) * 3 + 5
    mask = _mask([(0, 6), (1, 3), (2, 6), (0, 1)], 6)
    w = masked_whiten(x, mask)
    vals = w[mask]
    assert vals.mean().item() == pytest.approx(0, abs=1e-5) and vals.var(unbiased=True).item() == pytest.approx(1, abs=1e-4)
    kept = masked_whiten(x, mask, shift_mean=False)[mask]
    assert kept.mean().item() == pytest.approx(x[mask].mean().item(), rel=1e-5)
    assert not w[~mask].any()


def test_losses_clip_where_ppo_says():
    mask = torch.ones(1, 4, dtype=torch.bool)
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))  # ratios
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    batch = PPOBatch(inputs=None, targets=None, rows=None, old_logps=old, advantages=adv,
                     old_values=torch.zeros(1, 4), returns=torch.tensor([[1.0, 1.0, -1.0, 0.1]]))
    values = torch.tensor([[0.5, 0.1, -0.5, 0.3]])
    pg, vf, st = ppo_token_losses(logps, values, batch, mask, cliprange=0.2, cliprange_value=0.2)
    # per token: max(-A r, -A clip(r)): -1.2 (clipped), 0.8 (clipped), -1.1, -0.7
    assert pg.item() == pytest.approx(-1.2 + 0.8 - 1.1 - 0.7, abs=1e-6)
    assert st["clip_fraction"].item() == 2
    # values clipped to [-0.2, 0.2]: 0.5 * max((v - R)^2, (vc - R)^2)
    want = 0.5 * (max(0.25, 0.64) + max(0.81, 0.64) + max(0.25, 0.64) + max(0.04, 0.01))
    assert vf.item() == pytest.approx(want, abs=1e-6) and st["value_clip_fraction"].item() == 2


def test_adaptive_kl_moves_towards_the_target_at_most_20_percent_per_horizon():
    fixed = AdaptiveKL(0.05, None, 100)
    assert fixed.update(10.0, 100) == 0.05
    ctl = AdaptiveKL(0.05, target=1.0, horizon=100)
    assert ctl.update(10.0, 100) == pytest.approx(0.05 * 1.2)  # far above: +20% over a whole horizon
    assert ctl.update(0.9, 50) == pytest.approx(0.06 * (1 - 0.1 * 0.5))  # below: by the error times n / horizon
    assert ctl.update(0.1, 100) == pytest.approx(0.057 * 0.8)  # the error is clipped to -20%


def test_the_objective_is_policy_plus_vf_coef_value_over_completion_tokens():
    cfg = tiny_config().model
    torch.manual_seed(0)
    model = PolicyAndValue(Transformer(cfg), RewardModel(Transformer(cfg), cfg.dim))
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    targets = torch.full((2, 7), IGNORE_INDEX)
    targets[0, 3:6] = torch.randint(0, cfg.vocab_size, (3,), generator=g)
    targets[1, 1:7] = torch.randint(0, cfg.vocab_size, (6,), generator=g)
    mask = targets != IGNORE_INDEX
    with torch.no_grad():
        logits, values = model(inputs)
        old = token_logps(logits, targets, 0.7)
    batch = PPOBatch(inputs=inputs, targets=targets, rows=None, old_logps=old, old_values=values * mask,
                     advantages=torch.randn(2, 7, generator=g) * mask, returns=torch.randn(2, 7, generator=g) * mask)
    obj = ProximalPolicy(vf_coef=0.25, temperature=0.7)
    out = obj.loss(model, batch, torch.device("cpu"))
    assert obj.weight(batch) == 9 and int(out.tokens) == 9
    # on-policy: ratio 1, so the policy loss is -sum(A) and the value loss 0.5 sum((V - R)^2)
    want = -batch.advantages.sum() + 0.25 * 0.5 * (((values - batch.returns) * mask) ** 2).sum()
    assert out.ce_sum.item() == pytest.approx(want.item(), rel=1e-5)
    out.ce_sum.backward()
    assert model.policy.layers["0"].self_attn.q_proj.weight.grad is not None
    assert model.value.score.weight.grad.abs().sum() > 0
    m = obj.pop_metrics()
    assert m["ratio"] == pytest.approx(1.0) and m["approx_kl"] == pytest.approx(0.0, abs=1e-10) and math.isfinite(m["value_loss"])
