"""The pretrain stage through the local launcher: the job trains, its metrics reach the stage's MLflow
run, and a failing job raises an error that names its log."""

from pathlib import Path

import pytest

from fixtures.trainer_data import make_tokens, tiny_config
from infra.workspace import Workspace
from stages.base import StageContext
from stages.pretrain import TrainingJobFailed, run


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("pretrain-tokens"))


def context(tmp: Path, tokens: Path, run_id=None, tracking=None, **pretrain) -> StageContext:
    cfg = tiny_config(**pretrain)
    cfg.infra.workdir = str(tmp / "ws")
    if tracking:
        cfg.infra.tracking_uri = tracking
    return StageContext(cfg, Workspace.from_config(cfg), tmp / "out", inputs={"tokens": tokens}, run_id=run_id)


@pytest.mark.slow
def test_stage_trains_and_logs_to_mlflow(tmp_path, tokens):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("pretrain-test", artifact_location=str(tmp_path / "mlruns"))
    run_id = client.create_run(exp).info.run_id
    ctx = context(tmp_path, tokens, run_id=run_id, tracking=uri, steps=8, warmup_steps=1)
    ctx.cfg.infra.system_metrics_s = 600.0  # longer than the job: only the sample taken as it ends
    figures = []
    ctx.log_figure = lambda fig, name: figures.append((name, len(fig.axes)))
    summary = run(ctx)
    assert summary["steps"] == 8 and summary["loss"] < 5.5 and "val_loss" in summary
    assert (tmp_path / "out" / "result.json").is_file()
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == list(range(1, 9))
    # per-layer activation statistics at every logged step, and their picture in the artifact
    assert [m.step for m in client.get_metric_history(run_id, "act_rms/layer_00")] == list(range(1, 9))
    assert (tmp_path / "out" / "activations.png").stat().st_size > 10_000
    assert figures == [("activations.png", 2)]  # and the figure itself into the run (log_figure)
    # The estimator's FLOPs per step sit next to torch's FLOP counter on the real model (issue 8).
    params = client.get_run(run_id).data.params
    estimated, measured = float(params["estimate.flops_per_step"]), float(params["measured.flops_per_step"])
    assert abs(measured - estimated) / estimated < 0.05
    # MLflow's system metrics of the job's machine: however short the job, at least its last sample
    logged = client.get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(logged), sorted(logged)
    # The job's one checkpoint (the final one) is a LoggedModel of the run, logged by rank 0 under torchrun.
    (model,) = client.search_logged_models([exp], filter_string=f"source_run_id = '{run_id}'")
    assert model.name == "pretrain-step-8" and model.tags["checkpoint_uri"].endswith("checkpoints/step_00000008")
    assert {m.key: m.value for m in model.metrics}["loss"] == history[-1].value


def test_failed_job_raises_naming_the_log(tmp_path, tokens):
    ctx = context(tmp_path, tokens)
    ctx.inputs = {"tokens": tmp_path / "nowhere"}
    with pytest.raises(TrainingJobFailed, match=r"log: .*\.log") as err:
        run(ctx)
    assert "nowhere" in str(err.value)
