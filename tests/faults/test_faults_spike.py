"""Loss spikes: a poisoned data window is detected, its updates skipped, the job rolls back to the last
good checkpoint and skips the window, ending within 2% of a clean run; a NaN step is skipped; spikes
that keep coming end the job `diverged`. Every event is in the metrics stream with its step."""

from __future__ import annotations

import json
from pathlib import Path

from faults_jobs import job, run_in_process

# z_threshold 20, not the default 6: the poisoned steps (loss x 50) sit thousands of std above the mean,
# while early clean steps reach z 8.1 on the gradient norm with a 3-step history (measured, init seeds
# 0..15: max 1.7 at seed 0, 8.1 at seed 10, which then skipped a clean step 4).
SPIKE = {"min_history": 3, "window": 8, "z_threshold": 20.0, "max_skips": 2, "max_rollbacks": 1}


def events(spec) -> list[dict]:
    rows = [json.loads(line) for line in (Path(spec.output) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if {"spike_skipped", "spike_rollback", "diverged"} & set(r)]


def test_poisoned_window_is_skipped_and_rolled_back(byte_tokens, tmp_path):
    common = dict(steps=14, checkpoint={"every": 4}, spike=SPIKE, lr=2e-3)
    clean = run_in_process(job(tmp_path, byte_tokens, "clean", **common))
    spec = job(tmp_path, byte_tokens, "poisoned", faults={"poison_step": 9, "poison_steps": 2, "poison_factor": 50.0},
               **common)
    res = run_in_process(spec)
    assert clean.status == res.status == "completed" and res.steps == 14
    ev = events(spec)
    skipped = [e["step"] for e in ev if "spike_skipped" in e]
    rollbacks = [e for e in ev if "spike_rollback" in e]
    assert skipped == [10, 11]  # steps 10 and 11 (1-based) read the poisoned window
    assert len(rollbacks) == 1 and rollbacks[0]["rollback_to_step"] == 8.0
    assert all(e["spike_loss"] > 3 * clean.metrics["loss"] for e in ev if "spike_skipped" in e)
    assert res.metrics["spike_rollbacks"] == 1 and res.metrics["spike_skipped_steps"] == 2
    # Same number of applied updates over slightly different data: the end is within 2% of clean on the
    # same validation rows (measured over init seeds 0..15: 0.00..0.46%). The last training loss is of a
    # different batch (the skipped window shifts the data), so it gets its batch-to-batch spread: measured
    # 0.03..5.4% apart, bound 10%.
    assert abs(res.metrics["val_loss"] - clean.metrics["val_loss"]) / clean.metrics["val_loss"] < 0.02
    assert abs(res.metrics["loss"] - clean.metrics["loss"]) / clean.metrics["loss"] < 0.10


def test_nan_step_is_skipped_and_endless_spikes_diverge(byte_tokens, tmp_path):
    nan = run_in_process(job(tmp_path, byte_tokens, "nan", steps=5, spike=SPIKE, faults={"nan_step": 3}))
    assert nan.status == "completed" and nan.metrics["spike_skipped_steps"] == 1
    assert nan.metrics["spike_rollbacks"] == 0
    spec = job(tmp_path, byte_tokens, "bad", steps=12, checkpoint={"every": 2}, spike=SPIKE,
               faults={"poison_step": 5, "poison_steps": 50, "poison_factor": 50.0})
    res = run_in_process(spec)
    assert res.status == "diverged" and "max_rollbacks=1" in res.message
    assert res.checkpoint is not None and res.checkpoint.endswith("step_00000004")  # the last good one
    assert any("diverged" in e for e in events(spec))
