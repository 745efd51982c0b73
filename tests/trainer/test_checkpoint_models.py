"""Every checkpoint a training job commits is an MLflow 3 LoggedModel: named `STAGE-step-N`, its source
the stage's run, the checkpoint's URI in the store and the stage's fingerprint on it, the metrics of
its step linked to it; the weights stay in the store. Against the sqlite file and a real server; and a
tracking failure never fails the job."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fixtures.trainer_data import tiny_config
from infra.launch.job import JobSpec, TrackingRef
from infra.store import open_store
from infra.tracking import RunLogger, Tracker
from trainer.checkpoint import checkpoint_key, committed_steps


@pytest.fixture(params=["sqlite", "server"])
def tracking_uri(request, tmp_path_factory):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('ckpt-models') / 'mlflow.db'}"
    return request.getfixturevalue("mlflow_server")


def _spec(tmp_path: Path, tokens: Path, tracking: TrackingRef) -> JobSpec:
    # 5 steps, async checkpoints at 2 and 4 and the final one at 5; keep_last 1 prunes the store, not MLflow
    cfg = tiny_config(steps=5, micro_batch_size=2, global_batch_size=8, warmup_steps=1, activation_stats=False,
                      checkpoint={"every": 2, "keep_last": 1}).model_dump(mode="json")
    return JobSpec(job_id="ckpt-models", stage="pretrain", config=cfg, inputs={"tokens": str(tokens)},
                   output=(tmp_path / "out").as_uri(), workdir=str(tmp_path / "work"), tracking=tracking,
                   resume="none")


def test_each_committed_checkpoint_is_a_logged_model(tracking_uri, byte_tokens, tmp_path):
    from trainer.trainer import Trainer

    tracker = Tracker(tracking_uri, f"ckpt-models-{tmp_path.name}", artifact_location=str(tmp_path / "mlruns"))
    with tracker.stage_run("pretrain", "fp-0123456789", tags={"stage": "pretrain"}) as run_id:
        spec = _spec(tmp_path, byte_tokens, TrackingRef(uri=tracking_uri, experiment=tracker.experiment, run_id=run_id))
        result = Trainer(spec).run()
    assert result.status == "completed" and result.steps == 5

    client = MlflowClient(tracking_uri)
    models = client.search_logged_models([tracker.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    store = open_store(spec.output)
    assert committed_steps(store) == [5]  # the store kept only the last; MLflow has a record of each
    want = {2: store.url(checkpoint_key(2)), 4: store.url(checkpoint_key(4)), 5: store.url(checkpoint_key(5))}
    assert result.checkpoint == want[5]
    by_step = {int(m.tags["step"]): m for m in models}
    assert sorted(by_step) == [2, 4, 5] and len(models) == 3
    # The reference: what rank 0 wrote to metrics.jsonl, latest value of each key at or before the step.
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for step, model in by_step.items():
        assert model.name == f"pretrain-step-{step}"
        assert model.source_run_id == run_id and str(model.status) == "READY" and model.model_type == "checkpoint"
        assert model.tags["checkpoint_uri"] == model.params["checkpoint_uri"] == want[step]
        assert model.tags["fingerprint"] == model.params["fingerprint"] == "fp-0123456789"
        assert model.params["step"] == str(step) and model.tags["mlflow.model.isExternal"] == "true"
        expected: dict[str, tuple[int, float]] = {}
        for row in rows:
            if row["step"] <= step:
                expected.update({k: (row["step"], float(v)) for k, v in row.items() if k != "step"})
        linked = {m.key: (m.step, m.value) for m in model.metrics}
        assert set(linked) == set(expected) and "loss" in linked and linked["loss"][0] == step
        for key, (at, value) in expected.items():
            assert linked[key][0] == at and linked[key][1] == pytest.approx(value, rel=1e-6), key
        assert all(m.run_id == run_id for m in model.metrics)
    assert "val_loss" in {m.key for m in by_step[5].metrics}  # the final evaluation belongs to the last one
    # Linking did not log any value twice into the run's own curves, and no weights went into MLflow.
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4, 5]
    assert {a.path for a in client.list_artifacts(run_id)} <= {"activations.png"}
    assert [a.path for a in client.list_logged_model_artifacts(by_step[2].model_id)] == ["MLmodel"]
    # The run page lists them as its outputs, at their steps.
    outputs = client.get_run(run_id).outputs.model_outputs
    assert sorted((o.step, o.model_id) for o in outputs) == sorted((s, m.model_id) for s, m in by_step.items())


def test_a_tracking_failure_only_warns(tmp_path, caplog):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "ckpt-fail", artifact_location=str(tmp_path / "mlruns"))
    run_id = tracker.start_run("pretrain", tags={"stage": "pretrain", "fingerprint": "fp"})
    logger = RunLogger(uri, run_id)
    logger.log_metrics({"loss": 2.0}, step=1)
    tracker.client.delete_run(run_id)  # a deleted run takes no more outputs or metrics: MLflow refuses
    with caplog.at_level(logging.WARNING, logger="infra.tracking"):
        assert logger.log_checkpoint_model(1, "file:///ckpt/step_00000001", "pretrain") is None
    assert "LoggedModel for checkpoint step 1" in caplog.text
    (model,) = tracker.client.search_logged_models([tracker.experiment_id])
    assert str(model.status) == "FAILED"  # created, then refused: marked, never left PENDING
    assert RunLogger(None, None).log_checkpoint_model(1, "file:///x", "pretrain") is None  # no tracking
