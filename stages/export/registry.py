"""Register the exported Hugging Face folder in the MLflow model registry.

The folder is logged as plain artifacts of the export stage's run (`hf/`), and a model version is
created from that artifact URI, recorded against the lifecycle run (the stage run's parent) so the
registry points back at the whole lifecycle. Plain artifacts rather than the transformers flavour:
it needs no model object in memory, works offline, and the folder is exactly what vLLM and our engine
load. Evaluate and serve read the version's `source`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def register_hf_folder(tracking_uri: str, run_id: str, hf_dir: str | Path, name: str,
                       tags: dict[str, str] | None = None, description: str = "") -> dict[str, Any]:
    """Log `hf_dir` under the run's `hf/` artifacts and register it as a new version of model `name`.
    Returns {"name", "version", "source", "run_id"}."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking_uri)
    client.log_artifacts(run_id, str(hf_dir), artifact_path="hf")
    run = client.get_run(run_id)
    source = f"{run.info.artifact_uri.rstrip('/')}/hf"
    lifecycle_run = run.data.tags.get("mlflow.parentRunId") or run_id
    try:
        client.create_registered_model(name, description="exported by eightfold's export stage")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code) and "already exists" not in str(exc):
            raise
    all_tags = {"stage_run_id": run_id, **(tags or {})}
    mv = client.create_model_version(name, source=source, run_id=lifecycle_run, tags=all_tags,
                                     description=description or None)
    return {"name": name, "version": int(mv.version), "source": source, "run_id": lifecycle_run}
