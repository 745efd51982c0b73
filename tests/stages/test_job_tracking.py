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
