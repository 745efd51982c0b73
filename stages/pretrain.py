"""The pretrain stage: write a job file for the built-in trainer, launch it (torchrun on this machine,
Slurm or Kubernetes, per `infra.launcher`), wait, and return the job's final metrics.

The job reads the packed `tokens` artifact (train/ and val/ split folders), trains `pretrain.steps`
optimizer steps of next-token prediction on the model in `model:` over the mesh in `parallel:`, and
writes metrics.jsonl and result.json into this stage's output folder. Rank 0 logs step metrics into
the stage's MLflow run (`ctx.run_id`).
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

from infra.launch import get_launcher
from infra.launch.base import read_result
from infra.launch.job import JobResult, JobSpec

from .activation_plot import plot_activation_stats
from .attempts import DivergenceBudgetSpent, TrainingDiverged, TrainingJobFailed, next_launch, settle
from .base import StageContext
from .job_tracking import fetch_output_file, job_step, job_tracking, replay_metrics

__all__ = ["TrainingJobFailed", "TrainingDiverged", "DivergenceBudgetSpent", "job_spec", "launch_and_wait", "run"]

log = logging.getLogger(__name__)


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
        output=ctx.job_output(),
        workdir=str(ctx.workspace.path("jobs", job_id)),
        tracking=job_tracking(ctx.cfg, ctx.workspace.tracking_uri, ctx.workspace.experiment, ctx.run_id),
        resume="latest",
    )


def _spike_config(ctx: StageContext, spec: JobSpec):
    section: object = ctx.cfg
    for part in spec.section.split("."):
        section = getattr(section, part)
    return section.spike


def _bad_nodes(spec: JobSpec) -> dict[str, str]:
    from infra.health import read_bad_nodes_from_store
    from infra.launch.base import endpoint_for
    from trainer.health import read_bad_nodes

    return {**read_bad_nodes(spec.workdir), **read_bad_nodes_from_store(spec.output, endpoint_for(spec))}


def _exclude_bad_nodes(launcher, spec: JobSpec, bad: dict[str, str]) -> str:
    """Nodes the failed job's health checks found bad (the per-node probe before the job, the trainer's
    pre-flight: reports in the job's output store, or in this machine's workdir when the store was what
    failed) go into the launcher's exclude file, which every later submit reads (Slurm: `--exclude`;
    Kubernetes: a required node affinity), so the task's retry runs elsewhere."""
    if not bad:
        return ""
    exclude = getattr(launcher, "exclude_file", None)
    if exclude is not None:
        from infra.launch.exclude import record_bad_nodes

        record_bad_nodes(exclude, sorted(bad), reason=f"{spec.job_id} pre-flight: " + "; ".join(bad.values()))
        return f"; pre-flight failed on {', '.join(sorted(bad))}: excluded from later submits ({exclude})"
    return f"; pre-flight failed on {', '.join(sorted(bad))} ({launcher.name} launcher: nothing to exclude)"


PROGRESS_EVERY_S = 30.0  # each look reads the job's metrics.jsonl from its output
# A job that wrote its completed result.json (rank 0, last, after every rank left the process group) gets
# this long to exit; trainer.__main__ gives its ranks 60 s to shut down before they leave at once.
TEARDOWN_GRACE_S = 90.0


def wait_reporting_progress(ctx: StageContext, spec: JobSpec, handle, timeout: float | None = None) -> int:
    """`handle.wait(timeout)` in slices; after each, the job's last step (its metrics.jsonl) goes to
    `ctx.report_progress` as a fraction of the job's steps when it moved. A job whose completed
    result.json is in but whose processes are still there TEARDOWN_GRACE_S later (a rank stuck in its
    interpreter's shutdown, in a library's thread or destructor) is cancelled and counts as completed:
    its work is committed, and waiting would only time the task out and retry it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    section: Any = spec.config
    for part in spec.section.split("."):  # pretrain, posttrain.sft, ...
        section = section.get(part, {}) if isinstance(section, dict) else {}
    total = int(section.get("steps") or 0)
    reported, done_at = None, None
    while True:
        left = PROGRESS_EVERY_S if deadline is None else min(PROGRESS_EVERY_S, max(0.0, deadline - time.monotonic()))
        if done_at is not None:
            left = min(left, max(0.0, done_at + TEARDOWN_GRACE_S - time.monotonic()))
        try:
            return handle.wait(left)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise
        if done_at is None:
            if _completed(spec):
                done_at = time.monotonic()
        elif time.monotonic() - done_at >= TEARDOWN_GRACE_S:
            handle.cancel()  # a rank terminated in its shutdown prints its stacks (trainer.__main__.exit_within)
            log.warning("%s: completed (result.json written) but its processes were still running %.0f s later; "
                        "cancelled them. Where they were:\n%s", spec.job_id, TEARDOWN_GRACE_S, _stacks(handle.log_path))
            return 0
        step = job_step(spec)
        if step is not None and step != reported and total > 0:
            ctx.report_progress(min(1.0, step / total), f"{spec.job_id}: step {step}/{total}")
            reported = step


def _stacks(log_path: Path) -> str:
    """The thread stacks faulthandler printed into a job's log (the job's scratch, and its log, go when the
    stage succeeds)."""
    if not log_path.exists():
        return f"(no log at {log_path})"
    lines = log_path.read_text(errors="replace").splitlines()
    picked = [line for line in lines if line.startswith(("Thread 0x", "Current thread 0x", '  File "'))]
    return "\n".join(picked[-200:]) or f"(no stacks in {log_path})"


def _completed(spec: JobSpec) -> bool:
    """This launch of the job wrote a completed result.json (not an earlier launch or job)."""
    try:
        result = read_result(spec)
    except ValueError:  # half-written or foreign: not ours yet
        return False
    return result is not None and result.status == "completed" and result.written_by(spec)


def launch_and_wait(ctx: StageContext, spec: JobSpec, timeout: float | None = None) -> JobResult:
    """Launch the job and wait. A job that resumes (`resume: latest`) into a folder an earlier attempt
    used learns from it (stages/attempts.py): its attempt number, the LR cap and the data windows to
    skip after a divergence. Raises TrainingJobFailed (or TrainingDiverged, after rolling the output
    back one checkpoint, or DivergenceBudgetSpent) when the job did not complete."""
    resumable = spec.resume == "latest"
    spike = _spike_config(ctx, spec) if resumable else None
    if spike is not None:
        spec = next_launch(spec, spike)
        if spec.attempt:
            ctx.log_metrics({"task.attempt": float(spec.attempt), "task.lr_scale": spec.lr_scale}, None)
    # the job's own config: an elastic retry may run on fewer nodes than the stage's config says
    launcher = get_launcher(type(ctx.cfg).model_validate(spec.config))
    job_file = spec.write(Path(spec.workdir) / "job.yaml")
    handle = launcher.submit(spec, job_file)
    try:
        code = wait_reporting_progress(ctx, spec, handle, timeout)
    except BaseException:  # Ctrl-C, a cancelled flow run, a timeout: the job must not outlive its task
        handle.cancel()
        raise
    result = launcher.result(spec)
    if code == 0 and result is not None and result.status == "completed":
        if spike is not None and spec.attempt:
            settle(spec, result, code, spike)
        return result
    tail = ""
    if handle.log_path.exists():
        tail = "".join(handle.log_path.read_text(errors="replace").splitlines(keepends=True)[-20:])
    status = result.status if result else "no result.json"
    message = result.message if result else ""
    error: type[TrainingJobFailed] = TrainingJobFailed
    bad = _bad_nodes(spec)
    event = _exclude_bad_nodes(launcher, spec, bad)
    if spike is not None:
        record = settle(spec, result, code, spike, bad_nodes=sorted(bad))
        event += f"; {record['event']}"
        ctx.log_metrics({f"task.{record['status']}": 1.0, **({"task.rollback_to_step": float(record["resume_step"])}
                                                            if "resume_step" in record else {})}, None)
        if record["status"] == "diverged":
            error = TrainingDiverged if "resume_step" in record else DivergenceBudgetSpent
    raise error(
        f"{spec.stage} job {spec.job_id} (attempt {spec.attempt}) ended with exit code {code} "
        f"({status}{': ' + message if message else ''}){event}; log: {handle.log_path}\n--- last lines ---\n{tail}"
    )


def run(ctx: StageContext) -> dict[str, Any]:
    from stages.ablations.choice import adopt_choice, compare_prediction
    from trainer.model import param_counts

    ctx, predicted = adopt_choice(ctx)  # the ablations' lr and batch size, unless pinned
    counts = param_counts(ctx.cfg.model)
    ctx.log_params({"params_total": counts["total"], "params_active": counts["active"]})
    spec = job_spec(ctx)
    result = launch_and_wait(ctx, spec)
    replay_metrics(spec, ctx.log_metrics)  # when the job's nodes could not reach the tracking store
    summary: dict[str, Any] = {"steps": result.steps, "params": counts["total"], **result.metrics, **predicted}
    summary.update(compare_prediction(summary))
    metrics = fetch_output_file(spec, "metrics.jsonl")
    if metrics is not None:
        plot_activation_stats(metrics, Path(ctx.out_dir) / "activations.png", f"pretrain {ctx.cfg.name}",
                              log_figure=ctx.log_figure)
    return summary
