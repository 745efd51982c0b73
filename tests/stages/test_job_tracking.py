"""A job logs to MLflow itself only where its nodes reach the tracking store (stages/job_tracking.py):
a sqlite URI is a path of this machine, so a Slurm or Kubernetes job gets none and the stage logs the
job's metrics.jsonl rows into its run afterwards."""

from __future__ import annotations

from fixtures.s3 import s3_endpoint, s3_store  # noqa: F401
from fixtures.trainer_data import tiny_config
from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from stages.job_tracking import job_tracking, replay_metrics


def _cfg(launcher: str) -> LifecycleConfig:
    data = tiny_config().model_dump(mode="json")
    data["infra"]["launcher"] = launcher
    return LifecycleConfig.model_validate(data)


def test_only_jobs_that_reach_the_tracking_store_get_it():
    sqlite, server = "sqlite:////home/me/.eightfold/mlflow.db", "http://mlflow:5000"
    assert job_tracking(_cfg("local"), sqlite, "e", "run").uri == sqlite
    for launcher in ("slurm", "kubernetes"):
        ref = job_tracking(_cfg(launcher), sqlite, "e", "run")
        assert (ref.uri, ref.run_id) == (None, None)
        assert job_tracking(_cfg(launcher), server, "e", "run").run_id == "run"


def test_the_stage_replays_what_an_untracked_job_wrote(s3_store, tmp_path):
    s3_store.put_bytes(b'{"step": 1, "loss": 5.0, "lr": 0.001}\n{"step": 2, "loss": 4.5, "note": "x"}\n',
                       "out/metrics.jsonl")
    spec = JobSpec(job_id="j", stage="pretrain", config={"infra": {"s3_endpoint_url": s3_store.endpoint_url}},
                   output=s3_store.url("out"), workdir=str(tmp_path / "w"),
                   tracking=job_tracking(_cfg("kubernetes"), "sqlite:///x.db", "e", "run"))
    logged = []
    assert replay_metrics(spec, lambda m, step: logged.append((step, m))) == 2
    assert logged == [(1, {"loss": 5.0, "lr": 0.001}), (2, {"loss": 4.5})]
    tracked = spec.model_copy(update={"tracking": job_tracking(_cfg("local"), "sqlite:///x.db", "e", "run")})
    assert replay_metrics(tracked, lambda m, step: logged.append(m)) == 0  # it logged them itself


def test_a_running_jobs_progress_is_reported_from_its_metrics(s3_store, tmp_path, monkeypatch):
    """While the stage waits, the job's last step in metrics.jsonl (in the store) goes to
    ctx.report_progress as a fraction of its steps, once per step it reached; a deadline still holds."""
    import pytest

    import stages.pretrain as pretrain
    from stages.base import StageContext
    from stages.job_tracking import job_step

    monkeypatch.setattr(pretrain, "PROGRESS_EVERY_S", 0.01)
    spec = JobSpec(job_id="j", stage="posttrain/sft", section="posttrain.sft",
                   config={"posttrain": {"sft": {"steps": 20}}, "infra": {"s3_endpoint_url": s3_store.endpoint_url}},
                   output=s3_store.url("out"), workdir=str(tmp_path / "w"))
    assert job_step(spec) is None  # nothing written yet
    rows = iter(['{"step": 5, "loss": 3.0}\n', '{"step": 5, "loss": 3.0}\n{"step": 10, "loss": 2.0}\n{"st',
                 '{"step": 5, "loss": 3.0}\n{"step": 10, "loss": 2.0}\n'])

    class Job:  # three slices without an end, each after the job wrote more, then done
        def wait(self, timeout):
            text = next(rows, None)
            if text is None:
                return 0
            s3_store.put_bytes(text.encode(), "out/metrics.jsonl")
            raise TimeoutError

    reports = []
    ctx = StageContext(cfg=None, workspace=None, out_dir=tmp_path, report_progress=lambda f, line: reports.append((f, line)))
    assert pretrain.wait_reporting_progress(ctx, spec, Job()) == 0
    assert reports == [(0.25, "j: step 5/20"), (0.5, "j: step 10/20")]  # a half-written line is skipped

    class Hangs:
        def wait(self, timeout):
            raise TimeoutError

    with pytest.raises(TimeoutError):
        pretrain.wait_reporting_progress(ctx, spec, Hangs(), timeout=0.05)
