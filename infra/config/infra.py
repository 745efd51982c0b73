"""`infra:` where work runs (launcher, devices) and where things are kept (store, tracking)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Section
from .launch import KubernetesConfig, SlurmConfig


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
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="used when launcher = slurm")
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="used when launcher = kubernetes")

    @field_validator("store")
    @classmethod
    def _store_scheme(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError(f"store must start with file:// or s3://, got {v!r}")
        return v
