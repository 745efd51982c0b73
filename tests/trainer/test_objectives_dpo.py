"""DPO: the sigmoid and IPO losses against values computed by hand, sequence log-probs against a loop,
the objective with a frozen reference equals the one with precomputed reference log-probs, and its
metrics."""

import math

import pytest
import torch

from fixtures.posttrain import posttrain_config
from trainer.loss import IGNORE_INDEX
from trainer.model import Transformer
from trainer.objectives import DirectPreference, PairBatch, dpo_loss, sequence_logps


def test_dpo_loss_matches_hand_computed_values():
    pc, pr, rc, rr = torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5])
    # h = (pc - rc) - (pr - rr) = 0.5 - (-0.5) = 1.0
    assert dpo_loss(pc, pr, rc, rr, beta=0.1).item() == pytest.approx(math.log(1 + math.exp(-0.1)), rel=1e-6)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5).item() == pytest.approx(0.47407698, rel=1e-6)  # -log sigmoid(0.5)
    # IPO: (h - 1 / (2 beta))^2 = (1 - 5)^2
    assert dpo_loss(pc, pr, rc, rr, beta=0.1, kind="ipo").item() == pytest.approx(16.0)
    with pytest.raises(ValueError, match="sigmoid or ipo"):
        dpo_loss(pc, pr, rc, rr, 0.1, kind="kto")


def test_sequence_logps_against_a_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.tensor([[1, 2, IGNORE_INDEX, 3, IGNORE_INDEX], [IGNORE_INDEX] * 4 + [6]])
    total, count = sequence_logps(logits, targets)
    want = [sum(torch.log_softmax(logits[b, s], -1)[targets[b, s]].item() for s in range(5)
                if targets[b, s] != IGNORE_INDEX) for b in range(2)]
    assert total.tolist() == pytest.approx(want, rel=1e-5)
    assert count.tolist() == [3, 1]


def _pairs():
    torch.manual_seed(1)
    inputs = torch.randint(0, 512, (4, 10))  # 2 chosen rows, then 2 rejected rows
    targets = torch.randint(0, 512, (4, 10))
    targets[:, :6] = IGNORE_INDEX  # the prompt
    return inputs, targets


def test_objective_reference_model_equals_precomputed_logps():
    cfg = posttrain_config()
    torch.manual_seed(0)
    ref = Transformer(cfg.model).eval()
    policy = Transformer(cfg.model)
    inputs, targets = _pairs()
    obj = DirectPreference(beta=0.1, reference=ref)
    batch = PairBatch(inputs=inputs, targets=targets, rows=torch.arange(2).numpy())
    a = obj.loss(policy, batch, torch.device("cpu"))
    m = obj.pop_metrics()
    with torch.no_grad():
        ref_lp, _ = sequence_logps(ref(inputs), targets)
        pol_lp, _ = sequence_logps(policy(inputs), targets)
    pre = PairBatch(inputs=inputs, targets=targets, rows=torch.arange(2).numpy(), ref_logps=ref_lp)
    b = DirectPreference(beta=0.1).loss(policy, pre, torch.device("cpu"))
    assert a.ce_sum.item() == pytest.approx(b.ce_sum.item(), rel=1e-6)
    h = (pol_lp[:2] - ref_lp[:2]) - (pol_lp[2:] - ref_lp[2:])
    assert a.ce_sum.item() == pytest.approx(float(-torch.nn.functional.logsigmoid(0.1 * h).sum()), rel=1e-5)
    assert obj.weight(batch) == 2 and int(a.tokens) == 2
    assert m["reward_margin"] == pytest.approx(float(0.1 * h.mean()), rel=1e-4, abs=1e-6)
    assert m["preference_accuracy"] == pytest.approx(float((h > 0).float().mean()))
    assert m["logps_chosen"] == pytest.approx(float(pol_lp[:2].mean()), rel=1e-5)
    # the policy equal to its reference: every implicit reward is 0 and the loss is log 2 per pair
    same = DirectPreference(beta=0.1, reference=policy).loss(policy, batch, torch.device("cpu"))
    assert same.ce_sum.item() == pytest.approx(2 * math.log(2), rel=1e-6)
    with pytest.raises(ValueError, match="reference"):
        DirectPreference().loss(policy, batch, torch.device("cpu"))


def test_rpo_adds_the_chosen_answers_per_token_nll():
    """rpo_alpha: the loss is DPO's plus alpha x the chosen rows' mean NLL per token, computed by hand."""
    cfg = posttrain_config()
    torch.manual_seed(0)
    policy = Transformer(cfg.model)
    inputs, targets = _pairs()
    targets[0, 8:] = IGNORE_INDEX  # chosen rows of different lengths: 2 and 4 answer tokens
    with torch.no_grad():
        ref_lp, _ = sequence_logps(policy(inputs), targets)
        pol_lp, count = sequence_logps(policy(inputs), targets)
    batch = PairBatch(inputs=inputs, targets=targets, rows=torch.arange(2).numpy(), ref_logps=ref_lp + 0.3)
    plain = DirectPreference(beta=0.1).loss(policy, batch, torch.device("cpu")).ce_sum.item()
    rpo = DirectPreference(beta=0.1, rpo_alpha=0.5).loss(policy, batch, torch.device("cpu")).ce_sum.item()
    nll = float(-(pol_lp[:2] / count[:2]).sum())
    assert count[:2].tolist() == [2, 4]
    assert rpo == pytest.approx(plain + 0.5 * nll, rel=1e-5)
