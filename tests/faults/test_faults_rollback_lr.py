"""The in-job rollback lowers the learning rate (seed on loss spikes: "roll back to an earlier checkpoint
and skip the batches that caused the spike, lower the learning rate"): with lr_factor_on_rollback=0.5
every step after the rollback applies half the schedule's LR (logged and in the optimizer), and the
data window skipped is exactly the poisoned one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults_jobs import job
from trainer.optim import lr_at

# z_threshold 20: the poisoned step (loss x 50) is thousands of std out, clean early steps reach z 8 on
# the gradient norm with a 3-step history (measured over init seeds; see test_faults_spike.py)
SPIKE = {"min_history": 3, "window": 8, "z_threshold": 20.0, "max_skips": 1, "max_rollbacks": 1,
         "lr_factor_on_rollback": 0.5}


def test_rollback_halves_lr_and_skips_the_poisoned_window(byte_tokens, tmp_path):
    from trainer.trainer import Trainer

    gbs = 8
    spec = job(tmp_path, byte_tokens, "rollback-lr", steps=9, checkpoint={"every": 3}, spike=SPIKE, lr=2e-3,
               global_batch_size=gbs, activation_stats=False,
               faults={"poison_step": 5, "poison_steps": 1, "poison_factor": 50.0})
    tr = Trainer(spec)
    res = tr.run()
    cfg = tr.train_cfg
    assert res.status == "completed" and res.steps == 9
    rows = [json.loads(line) for line in (Path(spec.output) / "metrics.jsonl").read_text().splitlines()]
    at = next(i for i, r in enumerate(rows) if "spike_rollback" in r)
    before = [r for r in rows[:at] if "loss" in r]
    after = [r for r in rows[at:] if "loss" in r]
    # Step 6 (1-based) read the poisoned samples [40, 48): skipped, then back to the step-3 checkpoint.
    assert [r["step"] for r in rows[:at] if "spike_skipped" in r] == [6]
    assert rows[at]["rollback_to_step"] == 3.0 and rows[at]["lr_scale"] == 0.5
    assert res.skip_windows == [[5 * gbs, 6 * gbs]]
    # Before the rollback the schedule's LR; after it, half of it at every step (steps 4..9 again).
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in after] == [4, 5, 6, 7, 8, 9]
    for r in before:
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg), rel=1e-12)
    for r in after:
        assert r["lr"] == pytest.approx(0.5 * lr_at(r["step"] - 1, cfg), rel=1e-12)
    # ... and the optimizer really applied it (not only the logged figure).
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * lr_at(cfg.steps - 1, cfg), rel=1e-12)
    # The re-run steps 4, 5 see the same data as before (same losses up to the LR change at step 4's update,
    # so step 4's loss is identical); after the window, no step spikes again.
    assert after[0]["loss"] == pytest.approx(before[3]["loss"], rel=1e-6)
    assert max(r["loss"] for r in after) < 2 * before[0]["loss"]
    assert tr.loader.next_sample == (9 + 1) * gbs  # nine steps' samples plus the one skipped window
