"""GRPO: group-normalised advantages and the clipped token loss (with clip-higher and the k3 KL)
against values computed by hand; rollouts become micro-batches whose targets are exactly the
completion tokens; the objective's loss is the token sum the loop turns into a token mean."""

import math

import pytest
import torch

from trainer.loss import IGNORE_INDEX
from trainer.objectives import GroupRelativePolicy, group_advantages, grpo_token_loss
from trainer.objectives.grpo import Rollout, rollout_batches


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    a = 0.5 / (std + 1e-4)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], rel=1e-6)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)


def test_clipped_token_loss_by_hand():
    old = torch.zeros(1, 4)
    logps = torch.tensor([[0.5, -0.5, 0.1, 9.0]])  # ratios e^0.5, e^-0.5, e^0.1, (masked)
    mask = torch.tensor([[True, True, True, False]])
    r = [math.exp(0.5), math.exp(-0.5), math.exp(0.1)]
    # A = +1: -min(r, clip(r, 0.8, 1.2)) per token
    loss, st = grpo_token_loss(logps, old, torch.tensor([1.0]), mask, epsilon=0.2)
    assert loss.item() == pytest.approx(-(1.2 + r[1] + r[2]), rel=1e-6)
    assert st["clipped"].item() == 1  # only token 0: a positive advantage is clipped above 1.2 alone
    # A = -1: -min(-r, -clip(r)) = max(r, clip(r))
    loss, _ = grpo_token_loss(logps, old, torch.tensor([-1.0]), mask, epsilon=0.2)
    assert loss.item() == pytest.approx(r[0] + 0.8 + r[2], rel=1e-6)
    # clip-higher: the upper bound becomes 1 + 0.3
    loss, _ = grpo_token_loss(logps, old, torch.tensor([1.0]), mask, epsilon=0.2, epsilon_high=0.3)
    assert loss.item() == pytest.approx(-(1.3 + r[1] + r[2]), rel=1e-6)
    # KL (k3) to the reference, beta = 0.5: exp(ref - logp) - (ref - logp) - 1 per token
    ref = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    kl = [math.exp(-x) + x - 1 for x in (0.5, -0.5, 0.1)]
    loss, st = grpo_token_loss(logps, old, torch.tensor([1.0]), mask, epsilon=0.2, beta=0.5, ref_logps=ref)
    assert loss.item() == pytest.approx(-(1.2 + r[1] + r[2]) + 0.5 * sum(kl), rel=1e-6)
    assert st["kl"].item() == pytest.approx(sum(kl), rel=1e-6)


def test_rollout_batches_target_the_completion_tokens():
    groups = [[Rollout([1, 2, 3], [7, 8], [-0.1, -0.2], "a"), Rollout([1, 2, 3], [9], [-0.3], "b")],
              [Rollout([4, 5], [6, 6, 6], [-0.4, -0.5, -0.6], "c"), Rollout([4, 5], [2], [-0.7], "d")]]
    batches, adv = rollout_batches(groups, [[1.0, 0.0], [0.0, 0.0]], micro_batch_size=4, pad_id=0)
    (b,) = batches
    assert b.inputs.tolist()[0] == [1, 2, 3, 7] and b.targets.tolist()[0] == [IGNORE_INDEX, IGNORE_INDEX, 7, 8]
    assert b.targets.tolist()[2] == [IGNORE_INDEX, 6, 6, 6]
    assert b.old_logps[2, 1:].tolist() == pytest.approx([-0.4, -0.5, -0.6])
    assert b.advantages.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4), 0, 0],
                                                  rel=1e-6)


def test_objective_sums_tokens_and_matches_the_formula():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 10))  # logits = an embedding lookup
    groups = [[Rollout([1, 2], [3, 4], [-2.0, -2.5], "x"), Rollout([1, 2], [5], [-1.0], "y")]]
    (batch,), _ = rollout_batches(groups, [[1.0, 0.0]], micro_batch_size=2, pad_id=0)
    obj = GroupRelativePolicy(epsilon=0.2)
    part = obj.loss(model, batch, torch.device("cpu"))
    assert obj.weight(batch) == int(part.tokens) == 3
    lp = torch.log_softmax(model(batch.inputs).float(), -1)
    mask = batch.targets != IGNORE_INDEX
    want = 0.0
    for i in range(2):
        for s in range(batch.inputs.shape[1]):
            if mask[i, s]:
                ratio = math.exp(lp[i, s, batch.targets[i, s]].item() - batch.old_logps[i, s].item())
                a = batch.advantages[i].item()
                want += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
    assert part.ce_sum.item() == pytest.approx(want, rel=1e-5)
    part.ce_sum.backward()  # differentiable through the policy's log-probs
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
    assert set(obj.pop_metrics()) == {"clip_fraction"}
