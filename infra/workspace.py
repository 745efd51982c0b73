"""Where a lifecycle keeps local state, artifacts and metrics, resolved from `infra:`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from infra.config import LifecycleConfig
from infra.store import Store, open_store


@dataclass
class Workspace:
    """Resolved locations: `workdir/` (logs, jobs, scratch), the artifact store and the MLflow URI."""

    workdir: Path
    store_uri: str
    tracking_uri: str
    experiment: str
    s3_endpoint_url: str | None = None

    @classmethod
    def from_config(cls, cfg: LifecycleConfig) -> "Workspace":
        workdir = Path(os.environ.get("EIGHTFOLD_WORKDIR") or cfg.infra.workdir).expanduser().resolve()
        store_uri = cfg.infra.store or f"file://{workdir / 'artifacts'}"
        tracking = cfg.infra.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{workdir / 'mlflow.db'}"
        endpoint = cfg.infra.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        return cls(workdir, store_uri, tracking, cfg.name, endpoint)

    @cached_property
    def store(self) -> Store:
        return open_store(self.store_uri, endpoint_url=self.s3_endpoint_url)

    def path(self, *parts: str) -> Path:
        p = self.workdir.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def logs(self) -> Path:
        return self.path("logs")

    @property
    def jobs(self) -> Path:
        return self.path("jobs")

    @property
    def mlflow_artifacts(self) -> Path:
        return self.path("mlflow-artifacts")
