"""What a training job reports to MLflow, and how, when its nodes cannot reach the tracking store.

Rank 0 of a job logs step metrics into the stage's MLflow run itself when it can reach the tracking
store: always under the local launcher (this machine), and on other nodes (Slurm, Kubernetes) when
the URI is a server (http, https, databricks). A sqlite or file URI names a path of this machine: a
rank elsewhere would open a database of its own there, and the curves would be lost. Such a job gets
no tracking; it writes metrics.jsonl to its output in the store as always, and the stage logs those
rows into its run once the job is over (`replay_metrics`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from infra.config import LifecycleConfig
from infra.launch.base import endpoint_for
from infra.launch.job import JobSpec, TrackingRef
from infra.store import StoreError, open_store
from trainer.job_io import is_local, local_path

SERVER_SCHEMES = ("http", "https", "databricks")


def job_tracking(cfg: LifecycleConfig, tracking_uri: str, experiment: str, run_id: str | None) -> TrackingRef:
    reachable = cfg.infra.launcher == "local" or urlparse(tracking_uri).scheme in SERVER_SCHEMES
    return TrackingRef(uri=tracking_uri if reachable else None, experiment=experiment,
                       run_id=run_id if reachable else None)


def fetch_output_file(spec: JobSpec, name: str) -> Path | None:
    """A file of the job's output as a local path (read through the store when the output is remote,
    into the job's workdir on this machine), or None if the job wrote none."""
    if is_local(spec.output):
        path = local_path(spec.output) / name
        return path if path.is_file() else None
    store = open_store(spec.output, endpoint_url=endpoint_for(spec))
    if not store.exists(name):
        return None
    return store.get_file(name, Path(spec.workdir) / "from-output" / name)


def replay_metrics(spec: JobSpec, log_metrics) -> int:
    """Log the job's metrics.jsonl rows through `log_metrics(metrics, step)` when the job could not
    log them itself (no tracking in its spec); returns the rows logged."""
    if spec.tracking.uri is not None:
        return 0
    path = fetch_output_file(spec, "metrics.jsonl")
    if path is None:
        return 0
    rows = 0
    for line in path.read_text().splitlines():
        row: dict[str, Any] = json.loads(line)
        step = int(row.pop("step", 0))
        numbers = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            log_metrics(numbers, step)
            rows += 1
    return rows


def job_step(spec: JobSpec) -> int | None:
    """The last step in the job's metrics.jsonl (rank 0 copies it to a store output every ~10 s), or
    None before the first row or when the store does not answer this time."""
    try:
        path = fetch_output_file(spec, "metrics.jsonl")
    except (OSError, StoreError):
        return None
    if path is None:
        return None
    last = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            last = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):  # a line still being written
            continue
    return last
