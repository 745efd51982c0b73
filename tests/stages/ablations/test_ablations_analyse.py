"""The stage's analysis on proxy results made from a known loss surface (no training): it picks the
best learning rate per size, carries it to the target size, picks the batch size of the largest
size, and predicts the target's loss from the power law."""

import math

import numpy as np

from infra.config import load_config
from stages.ablations.proxies import plan_sweep, target_budget
from stages.ablations.runner import ProxyResult
from stages.ablations.stage import analyse

A, B, E = 60.0, 0.16, 1.9


def law(C):
    return A * C**-B + E


def best_lr_of(n):
    return 0.5 * n**-0.4  # the optimum drifts down with size


def results_for(cfg, noise=0.0, seed=0, batch_penalty=None):
    rng = np.random.default_rng(seed)
    out = []
    for p in plan_sweep(cfg):
        lr = p.axes["lr"]
        loss = law(p.flops) + 0.05 * (math.log(lr) - math.log(best_lr_of(p.params))) ** 2 + rng.normal(0, noise)
        if batch_penalty:
            loss += batch_penalty(p.axes["global_batch_size"])
        if lr > 0.2:
            loss = math.inf  # diverged
        out.append(ProxyResult(name=p.name, fingerprint="0" * 16, uri="", status="completed" if math.isfinite(loss)
                               else "diverged", val_loss=loss, loss=loss, cached=False, mlflow_run_id=None,
                               started=0.0, ended=1.0, point=p.as_dict()))
    return out


def config(**sweep):
    cfg = load_config("tiny")
    lrs = list(np.geomspace(1e-3, 3e-2, 7)) + [0.3]
    cfg.ablations = cfg.ablations.model_validate({**cfg.ablations.model_dump(), "sweep": {"lr": lrs, **sweep}})
    return cfg


def test_analysis_recovers_lr_drift_and_predicts_the_target_loss():
    cfg = config()
    choice = analyse(cfg, results_for(cfg, noise=0.002))
    target = target_budget(cfg)
    assert choice["diverged"] == len(choice["per_size"])  # one lr=0.3 run per size
    for row in choice["per_size"]:
        assert abs(math.log(row["lr"] / best_lr_of(row["params"]))) < 0.15
    t = choice["lr_transfer"]
    assert abs(t["slope"] + 0.4) < 0.1
    assert abs(math.log(choice["lr"] / best_lr_of(target["params"]))) < 0.25
    pred = choice["prediction"]
    assert pred["law"].startswith("L(C)") and math.isfinite(pred["std"])
    # Over noise seeds 0..199 the prediction missed by at most 0.092 (seed 0: 0.025), while the largest
    # proxy's own loss is 0.27 off; max(3 sd, 0.03) failed 10% of the seeds (the delta-method sd is small
    # when the per-size choices happen to line up), so the bound is the measured one.
    assert abs(pred["val_loss"] - law(target["flops"])) < 0.12


def test_batch_size_is_that_of_the_largest_size_and_changes_the_prediction_target():
    cfg = config(global_batch_size=[8, 16])
    choice = analyse(cfg, results_for(cfg, batch_penalty=lambda b: 0.0 if b == 8 else 0.05))
    assert choice["global_batch_size"] == 8
    # pretrain will run with batch 8: half the tokens, so the prediction is for that compute.
    assert choice["target"]["tokens"] == cfg.pretrain.steps * 8 * cfg.pretrain.seq_len
    assert choice["adopted_by_pretrain"]["global_batch_size"] == 8
