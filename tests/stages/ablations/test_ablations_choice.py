"""Pretrain's side of choice.json: the context it trains with, the prediction it reports, and what
the lifecycle logs into its parent run afterwards."""

import json

import pytest

from infra.config import load_config
from infra.workspace import Workspace
from stages.ablations.choice import adopt_choice, compare_prediction
from stages.base import StageContext


def _ctx(tmp_path, overrides=(), choice=None):
    # configs/tiny.yaml pins lr at 1.5e-3 (the choice here): unpin and start elsewhere so adoption shows.
    cfg = load_config("tiny", ["ablations.pinned=[]", "pretrain.lr=3e-3", *overrides])
    folder = tmp_path / "ablations"
    folder.mkdir()
    if choice is not None:
        (folder / "choice.json").write_text(json.dumps(choice))
    return StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out", inputs={"ablations": folder})


CHOICE = {"lr": 1.5e-3, "global_batch_size": 32, "schedule": "cosine",
          "prediction": {"val_loss": 4.2, "std": 0.1, "law": "L(C)"}}


def test_pretrain_context_takes_lr_and_batch_and_reports_the_prediction(tmp_path):
    params = {}
    ctx = _ctx(tmp_path, choice=CHOICE)
    ctx.log_params = params.update
    new, report = adopt_choice(ctx)
    assert (new.cfg.pretrain.lr, new.cfg.pretrain.global_batch_size) == (1.5e-3, 32)
    assert new.cfg.pretrain.steps == ctx.cfg.pretrain.steps and new.out_dir == ctx.out_dir
    assert report == {"ablations_lr": 1.5e-3, "ablations_global_batch_size": 32, "predicted_val_loss": 4.2,
                      "predicted_val_loss_std": 0.1}
    assert params["ablations_choice"]["lr"] == 1.5e-3


def test_pinned_values_stay_and_a_missing_choice_is_an_error(tmp_path):
    ctx = _ctx(tmp_path, ["ablations.pinned=[lr,global_batch_size]"], CHOICE)
    new, report = adopt_choice(ctx)
    assert new.cfg.pretrain.lr == ctx.cfg.pretrain.lr and "ablations_lr" not in report
    assert report["predicted_val_loss"] == 4.2  # still reported: it predicts the run at its own values
    (tmp_path / "x").mkdir()
    with pytest.raises(FileNotFoundError, match="choice.json"):
        adopt_choice(_ctx(tmp_path / "x"))


def test_prediction_error_and_parent_run_metrics():
    assert compare_prediction({"predicted_val_loss": 4.4, "val_loss": 4.0}) == pytest.approx(
        {"prediction_error": 0.1, "prediction_abs_error": 0.1})
    assert compare_prediction({"val_loss": 4.0}) == {}
    from tasks.ablations import log_prediction

    class Recorder:
        def __init__(self):
            self.logged = []

        def log_metrics(self, run_id, metrics, step=None):
            self.logged.append((run_id, metrics))

    rec = Recorder()
    figures = log_prediction(rec, "parent", {"predicted_val_loss": 4.4, "val_loss": 4.0, "predicted_val_loss_std": 0.2})
    assert rec.logged == [("parent", figures)]
    assert figures["ablations.prediction_error"] == pytest.approx(0.1) and figures["pretrain.val_loss"] == 4.0
    assert log_prediction(rec, "parent", {"val_loss": 4.0}) == {} and len(rec.logged) == 1
