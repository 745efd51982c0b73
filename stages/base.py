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
    a task, no-ops in a notebook). It returns a small dict of key figures for summaries.

    `out_uri` is where the artifact will live in the store (`{store}/{experiment}/{stage}/{fp}`): a
    training job writes its checkpoints, metrics and result straight there from its nodes, and the
    commit adds what is in `out_dir` and the manifest. None outside a task (jobs then write `out_dir`)."""

    cfg: LifecycleConfig
    workspace: Workspace
    out_dir: Path
    out_uri: str | None = None
    inputs: dict[str, Path] = field(default_factory=dict)
    input_uris: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None  # the stage's MLflow run, handed to training jobs
    log_metrics: Callable[[dict[str, float], int | None], None] = _noop
    log_params: Callable[[dict[str, Any]], None] = _noop
    log_artifact: Callable[[Path], None] = _noop
    report_progress: Callable[[float, str], None] = _noop  # a running job's fraction done and a line
    log_table: Callable[[dict[str, list], str], None] = _noop  # columns -> values, artifact file (.json)
    log_figure: Callable[[Any, str], None] = _noop  # a matplotlib figure, artifact file (.png)

    def job_output(self, *sub: str) -> str:
        """The URI a training job of this stage writes to (a sub-folder of the artifact for `sub`)."""
        if self.out_uri is None:
            return str(Path(self.out_dir, *sub).resolve())
        return "/".join([self.out_uri.rstrip("/"), *sub])
