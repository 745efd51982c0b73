"""The pretrain stage: write a job file for the built-in trainer, launch it (torchrun on this machine,
Slurm or Kubernetes, per `infra.launcher`), wait, and return the job's final metrics.

The job reads the packed `tokens` artifact (train/ and val/ split folders), trains `pretrain.steps`
optimizer steps of next-token prediction on the model in `model:` over the mesh in `parallel:`, and
writes metrics.jsonl and result.json into this stage's output folder. Rank 0 logs step metrics into
the stage's MLflow run (`ctx.run_id`).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from infra.launch import TrackingRef, get_launcher
from infra.launch.job import JobResult, JobSpec

from .base import StageContext


class TrainingJobFailed(RuntimeError):
    """The training job ended without `completed`; the message names its log and result."""


def job_spec(ctx: StageContext, stage: str = "pretrain", section: str = "pretrain") -> JobSpec:
    """The job file's content: the whole resolved config, every input URI, the output folder."""
    uris = dict(ctx.input_uris)
    for name, path in ctx.inputs.items():
        uris.setdefault(name, str(Path(path).resolve()))
    if "tokens" not in uris:
        raise ValueError(f"the {stage} stage needs a 'tokens' input (packed token splits); got {sorted(uris)}")
    job_id = f"{stage.replace('/', '-')}-{uuid.uuid4().hex[:8]}"
    return JobSpec(
        job_id=job_id,
        stage=stage,
        section=section,
        config=ctx.cfg.model_dump(mode="json"),
        inputs=uris,
        output=str(Path(ctx.out_dir).resolve()),
        workdir=str(ctx.workspace.path("jobs", job_id)),
        tracking=TrackingRef(uri=ctx.workspace.tracking_uri, experiment=ctx.workspace.experiment, run_id=ctx.run_id),
        resume="latest",
    )


def launch_and_wait(ctx: StageContext, spec: JobSpec, timeout: float | None = None) -> JobResult:
    launcher = get_launcher(ctx.cfg)
    job_file = spec.write(Path(spec.workdir) / "job.yaml")
    handle = launcher.submit(spec, job_file)
    code = handle.wait(timeout)
    result = launcher.result(spec)
    if code != 0 or result is None or result.status != "completed":
        tail = ""
        if handle.log_path.exists():
            tail = "".join(handle.log_path.read_text(errors="replace").splitlines(keepends=True)[-20:])
        status = result.status if result else "no result.json"
        message = result.message if result else ""
        raise TrainingJobFailed(
            f"{spec.stage} job {spec.job_id} ended with exit code {code} ({status}{': ' + message if message else ''}); "
            f"log: {handle.log_path}\n--- last lines ---\n{tail}"
        )
    return result


def run(ctx: StageContext) -> dict[str, Any]:
    from stages.ablations.choice import adopt_choice, compare_prediction
    from trainer.model import param_counts

    ctx, predicted = adopt_choice(ctx)  # the ablations' lr and batch size, unless pinned
    counts = param_counts(ctx.cfg.model)
    ctx.log_params({"params_total": counts["total"], "params_active": counts["active"]})
    spec = job_spec(ctx)
    result = launch_and_wait(ctx, spec)
    summary: dict[str, Any] = {"steps": result.steps, "params": counts["total"], **result.metrics, **predicted}
    summary.update(compare_prediction(summary))
    return summary
