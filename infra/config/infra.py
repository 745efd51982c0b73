"""`infra:` where work runs (launcher, devices) and where things are kept (store, tracking)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Section
from .launch import KubernetesConfig, SlurmConfig

# The lifecycle's tasks, as stages/registry.py names them (a test keeps the two lists equal).
TASKS = ("data", "tokenizer", "tokens", "ablations", "pretrain", "posttrain-sft", "posttrain-dpo", "posttrain-grpo",
         "posttrain-rm", "posttrain-ppo", "export", "evaluate", "serve")


class InfraConfig(Section):
    workdir: str = Field(".eightfold", description="local state: artifacts/, mlflow.db, logs/")
    store: str | None = Field(None, description="file:///abs/dir or s3://bucket/prefix; default file://{workdir}/artifacts")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, a local server); default AWS_ENDPOINT_URL")
    tracking_uri: str | None = Field(None, description="MLflow URI; default sqlite:///{workdir}/mlflow.db")
    launcher: Literal["local", "slurm", "kubernetes"] = "local"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    health_check: bool = Field(True, description="pre-flight health check before every training job")
    elastic: bool = Field(
        False, description="after a lost node, retry on the nodes left (fewer data-parallel replicas, the checkpoint "
                           "resharded) instead of waiting for as many nodes as before")
    retries: int = Field(2, ge=0, description="Prefect retries of a training stage's task, each resuming its job")
    retry_delay_s: float = Field(5.0, ge=0, description="delay before the first retry; doubles for each next one")
    system_metrics_s: float | None = Field(
        10.0, gt=0, description="seconds between samples of CPU, memory, disk, network (and GPU with nvidia-ml-py) "
        "that a training job's rank 0 logs into its MLflow run as system/*; None: none")
    max_concurrent_jobs: int | None = Field(
        None, ge=1, description="training jobs of this launcher running at once across flow runs (a Prefect global "
        "concurrency limit, eightfold-jobs-LAUNCHER); default 1 on local, unlimited on Slurm and Kubernetes")
    task_timeout_s: dict[str, float] = Field(
        default_factory=dict, description="Prefect timeout of a stage's task, by task name (e.g. {pretrain: 86400}), "
        "per attempt: a training job still running then is cancelled and the task retried; absent: no timeout")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="used when launcher = slurm")
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="used when launcher = kubernetes")

    @field_validator("task_timeout_s")
    @classmethod
    def _timeouts(cls, v: dict[str, float]) -> dict[str, float]:
        for name, seconds in v.items():
            if name not in TASKS:
                raise ValueError(f"task_timeout_s names {name!r}, not a task; tasks: {', '.join(TASKS)}")
            if not seconds > 0:
                raise ValueError(f"task_timeout_s.{name} = {seconds} must be > 0 seconds")
        return v

    @field_validator("store")
    @classmethod
    def _store_scheme(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError(f"store must start with file:// or s3://, got {v!r}")
        return v
