"""The job file a training stage hands to a launcher and the `result.json` a job ends with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

# A node's own folder for a job (set by the local launcher for each simulated node), or the cluster's
# scratch root of a node (set by the Slurm script): JobSpec.on_this_node. Every path a job writes for
# itself lives there; nodes share nothing but the object store.
NODE_DIR_ENV = "EIGHTFOLD_NODE_DIR"
NODE_SCRATCH_ENV = "EIGHTFOLD_NODE_SCRATCH"


class TrackingRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str | None = Field(None, description="MLflow tracking URI")
    experiment: str | None = None
    run_id: str | None = Field(None, description="the stage's MLflow run; rank 0 logs step metrics into it")


class JobSpec(BaseModel):
    """Everything a job needs: resolved config, where to read, where to write. Written as YAML."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    stage: str = Field(..., description="pretrain, ablations/<proxy>, posttrain/sft ...")
    section: str = Field("pretrain", description="the config section holding this job's TrainConfig")
    config: dict[str, Any] = Field(..., description="the full resolved LifecycleConfig")
    inputs: dict[str, str] = Field(default_factory=dict, description="name -> URI (tokens, tokenizer, init ...)")
    output: str = Field(..., description="URI of the output folder: checkpoints/, result.json, metrics.jsonl")
    workdir: str = Field(..., description="local scratch folder of this job (logs, staging)")
    tracking: TrackingRef = TrackingRef()
    resume: Literal["latest", "none"] = "latest"
    attempt: int = Field(0, ge=0, description="how many times this job was launched into the same output before")
    lr_scale: float = Field(
        1.0, gt=0, le=1, description="cap on the LR scale after resuming: lowered by the task after a diverged attempt"
    )
    skip_windows: list[list[int]] = Field(
        default_factory=list, description="[start, end) global sample windows never trained on (earlier spikes)"
    )
    previous_attempt_ended_at: float | None = Field(
        None, description="unix time the previous launch ended: the restart time of a task retry counts from it"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for every rank")

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
        return path

    @classmethod
    def read(cls, path: str | Path) -> "JobSpec":
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def on_this_node(self) -> "JobSpec":
        """This spec as one node of a job sees it: `workdir` is the node's own folder, so no node writes
        where another might. The launcher's node folder ($EIGHTFOLD_NODE_DIR: the local launcher's
        simulated nodes) or the cluster's node scratch ($EIGHTFOLD_NODE_SCRATCH/eightfold-jobs/<job_id>:
        the Slurm script, infra/slurm's TaskProlog); without either (one process, a notebook) the spec
        is returned unchanged."""
        if os.environ.get(NODE_DIR_ENV):
            return self.model_copy(update={"workdir": os.environ[NODE_DIR_ENV]})
        if os.environ.get(NODE_SCRATCH_ENV):
            scratch = Path(os.environ[NODE_SCRATCH_ENV]) / "eightfold-jobs" / self.job_id
            return self.model_copy(update={"workdir": str(scratch)})
        return self


class JobResult(BaseModel):
    """`result.json`: how a job ended. A task retries `failed` from `checkpoint`; `diverged` rolls back."""

    # a diverged job's last loss is NaN or Inf: written as JSON's NaN/Infinity (Python reads them back)
    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")

    status: Literal["completed", "diverged", "failed"]
    steps: int = 0
    checkpoint: str | None = Field(None, description="URI of the last committed checkpoint")
    metrics: dict[str, float] = Field(default_factory=dict)
    message: str = ""
    skip_windows: list[list[int]] = Field(default_factory=list, description="data windows skipped after spikes")
    resumed_from_step: int | None = Field(None, description="the checkpoint step this launch resumed from")
    job_id: str | None = Field(None, description="the job that wrote it (a forced re-run's output may hold an old one)")
    attempt: int | None = Field(None, description="which launch of that job wrote it")

    def written_by(self, spec: JobSpec) -> bool:
        return (self.job_id, self.attempt) == (spec.job_id, spec.attempt)
