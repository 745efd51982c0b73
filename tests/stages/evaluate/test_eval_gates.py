"""Gates: absolute bounds and losses against a baseline in the metric's own direction, every failure
reported with the variant, task, metric, values and the gate."""

from __future__ import annotations

import pytest

from infra.config.evaluate import GateConfig
from stages.evaluate.gates import GateFailed, check_gates


def _summ(values: dict[str, tuple[float, float]]):
    """variant -> (bits_per_byte, exact_match)"""
    return {v: {"metrics": {"eightfold_heldout_ppl": {"bits_per_byte": {"value": b, "higher_is_better": False}},
                            "eightfold_arith": {"exact_match": {"value": e, "higher_is_better": True}}}}
            for v, (b, e) in values.items()}


S = _summ({"pretrain": (2.00, 0.10), "sft": (2.05, 0.30), "grpo": (2.30, 0.25)})


def gate(**kw):
    return GateConfig(**kw)


def test_loss_follows_the_metric_direction():
    ok = check_gates([gate(variant="sft", task="eightfold_heldout_ppl", metric="bits_per_byte", baseline="pretrain",
                           max_loss=0.1),  # +0.05 bits/byte: a loss of 0.05
                      gate(variant="grpo", task="eightfold_arith", metric="exact_match", baseline="pretrain",
                           max_loss=0.0)],  # accuracy rose: a negative loss
                     S)
    assert all(r.passed for r in ok) and len(ok) == 2


def test_a_rise_in_perplexity_fails_naming_everything():
    g = gate(variant="grpo", task="eightfold_heldout_ppl", metric="bits_per_byte", baseline="pretrain", max_loss=0.1)
    with pytest.raises(GateFailed) as err:
        check_gates([g], S)
    msg = str(err.value)
    for part in ("variant 'grpo'", "eightfold_heldout_ppl", "bits_per_byte", "2.3", "pretrain 2", "loss of 0.3",
                 "0.1 allowed"):
        assert part in msg, part
    assert err.value.failures[0].value == 2.30 and err.value.failures[0].baseline_value == 2.00


def test_relative_losses_and_wildcards_report_every_failure():
    g = gate(variant="*", task="eightfold_arith", metric="exact_match", baseline="sft", max_loss=0.1, relative=True)
    with pytest.raises(GateFailed) as err:
        check_gates([g], S)
    failed = {f.variant for f in err.value.failures}
    assert failed == {"pretrain", "grpo"}  # 0.10 and 0.25 vs 0.30: relative losses 0.67 and 0.17
    assert "2 evaluation gate(s) failed" in str(err.value)


def test_absolute_bounds():
    assert check_gates([gate(variant="sft", task="eightfold_arith", metric="exact_match", min=0.3)], S)[0].passed
    with pytest.raises(GateFailed, match="below the minimum 0.2"):
        check_gates([gate(variant="pretrain", task="eightfold_arith", metric="exact_match", min=0.2)], S)


def test_a_gate_on_something_not_evaluated_is_an_error():
    with pytest.raises(ValueError, match="variant 'dpo' was not evaluated"):
        check_gates([gate(variant="dpo", task="eightfold_arith", metric="exact_match", min=0.2)], S)
    with pytest.raises(ValueError, match="metric 'acc' not in eightfold_arith"):
        check_gates([gate(variant="sft", task="eightfold_arith", metric="acc", min=0.2)], S)
