"""The noise a post-training gain is judged against: the binomial standard error of one accuracy and
the paired standard error of a change on the same items, each checked against scipy / numpy computed
another way (and the paired one against McNemar's discordant-pair form)."""

import math

import numpy as np
import pytest
from scipy import stats

from stages.posttrain.accuracy import binomial_se, outcome_bits, paired_change


def test_binomial_se_matches_bernoulli_std():
    outcomes = np.array([1] * 37 + [0] * 187, dtype=float)  # 37 of 224
    assert binomial_se(outcomes.mean(), len(outcomes)) == pytest.approx(outcomes.std(ddof=0) / math.sqrt(224))
    assert binomial_se(0.0, 10) == 0.0
    with pytest.raises(ValueError, match="n=0"):
        binomial_se(0.5, 0)


def test_paired_change_matches_scipy_sem_and_discordant_counts():
    rng = np.random.default_rng(0)
    before = rng.random(300) < 0.3
    after = before.copy()
    after[rng.choice(300, 60, replace=False)] ^= True  # flip 60 outcomes either way
    gain, se = paired_change(before.tolist(), after.tolist())
    d = after.astype(float) - before.astype(float)
    assert gain == pytest.approx(d.mean()) and se == pytest.approx(stats.sem(d))
    # McNemar's form: c gains, b losses on n items -> var = ((b + c) - (c - b)^2 / n) / (n - 1)
    c, b, n = int(((~before) & after).sum()), int((before & ~after).sum()), 300
    assert se == pytest.approx(math.sqrt(((b + c) - (c - b) ** 2 / n) / (n - 1) / n))
    # the paired error is far below the unpaired one when most items agree
    unpaired = math.hypot(binomial_se(before.mean(), n), binomial_se(after.mean(), n))
    assert se < unpaired


def test_paired_change_edge_cases():
    assert paired_change([True, False], [True, False]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same non-empty items"):
        paired_change([True], [True, False])
    assert outcome_bits([True, False, True]) == "101"


def test_preference_accuracy_uses_every_heldout_near_miss(tmp_path):
    import torch

    from fixtures.posttrain import make_chat_tokenizer, posttrain_config
    from infra.config.posttrain import TaskConfig
    from stages.posttrain.accuracy import preference_accuracy
    from stages.posttrain.data import heldout
    from trainer.model import Transformer

    tok_dir = make_chat_tokenizer(tmp_path / "tok")
    cfg = posttrain_config()
    torch.manual_seed(0)
    sd = Transformer(cfg.model).state_dict()
    task = TaskConfig(max_operand=9, heldout_size=12)
    full = preference_accuracy(sd, cfg.model, tok_dir, task, None)
    assert full["n"] == 6 * len(heldout(task)) == len(full["wins"])  # 6 near misses per held-out problem
    assert full["accuracy"] == pytest.approx(sum(full["wins"]) / full["n"])
    assert full["se"] == pytest.approx(binomial_se(full["accuracy"], full["n"]))
    part = preference_accuracy(sd, cfg.model, tok_dir, task, 10)
    assert part["n"] == 10 and part["wins"] == full["wins"][:10]
