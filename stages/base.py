"""What every stage function receives: resolved inputs, an output folder and logging hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infra.config import LifecycleConfig
from infra.workspace import Workspace


def _noop(*_a: Any, **_k: Any) -> None:
    return None


@dataclass
class StageContext:
    """A stage reads `inputs` (local folders of committed upstream artifacts), writes into `out_dir`
    (committed by the caller after it returns) and reports through the log hooks (MLflow when run by
    a task, no-ops in a notebook). It returns a small dict of key figures for summaries."""

    cfg: LifecycleConfig
    workspace: Workspace
    out_dir: Path
    inputs: dict[str, Path] = field(default_factory=dict)
    input_uris: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None  # the stage's MLflow run, handed to training jobs
    log_metrics: Callable[[dict[str, float], int | None], None] = _noop
    log_params: Callable[[dict[str, Any]], None] = _noop
    log_artifact: Callable[[Path], None] = _noop
