"""One stage call with the machinery every stage shares: fingerprint, cache by committed manifest,
an MLflow nested run (a cache hit gets one too, tagged cached), commit of the output, and a Prefect
markdown artifact with links."""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from infra.artifacts import (Artifact, artifact_prefix, code_version, commit_artifact, find_artifact, fingerprint,
                             latest_artifact)
from infra.config import LifecycleConfig
from infra.lease import StoreLease, lease_key
from infra.store import FileStore
from infra.tracking import Tracker, flatten_params
from infra.workspace import Workspace
from stages.attempts import DivergenceBudgetSpent
from stages.base import StageContext
from stages.registry import STAGES, stage_inputs

LEASE_POLL_S = 2.0  # how often a run waiting for another's build of the same artifact looks again


@dataclass(frozen=True)
class ArtifactRef:
    """What a stage task returns: enough to find the committed artifact again (serialisable)."""

    stage: str
    fingerprint: str
    uri: str
    cached: bool = False
    summary: dict | None = None


class MissingUpstream(RuntimeError):
    pass


class InjectedFault(RuntimeError):
    """A failure raised on purpose (tests and drills), never in normal runs."""


FAULT_STAGE_ENV = "EIGHTFOLD_FAULT_FAIL_STAGE"
FAULT_ONCE_FILE_ENV = "EIGHTFOLD_FAULT_ONCE_FILE"


def _maybe_inject_fault(stage: str) -> None:
    """Fail `stage` once, after it ran and before it commits, when EIGHTFOLD_FAULT_FAIL_STAGE names it
    and the file EIGHTFOLD_FAULT_ONCE_FILE exists (deleted here, so the retry goes through). Off
    unless both are set: this is how the retry-from-the-UI test makes a run fail deterministically."""
    once = os.environ.get(FAULT_ONCE_FILE_ENV)
    if os.environ.get(FAULT_STAGE_ENV) != stage or not once:
        return
    try:
        Path(once).unlink()
    except FileNotFoundError:
        return
    raise InjectedFault(f"{stage}: injected fault ({FAULT_STAGE_ENV}={stage}, {once} removed; a retry will pass)")


def stage_fingerprint(cfg: LifecycleConfig, stage: str, inputs: dict[str, ArtifactRef]) -> str:
    spec = STAGES[stage]
    return fingerprint(stage, spec.section(cfg), {k: v.fingerprint for k, v in inputs.items()})


def is_committed(cfg: LifecycleConfig, stage: str, inputs: dict[str, ArtifactRef]) -> bool:
    """Whether this stage's artifact for these inputs exists (the task would be a cache hit)."""
    ws = Workspace.from_config(cfg)
    return find_artifact(ws.store, ws.experiment, stage, stage_fingerprint(cfg, stage, inputs)) is not None


def resolve_upstream(cfg: LifecycleConfig, stage: str, pinned: dict[str, str] | None = None) -> dict[str, ArtifactRef]:
    """The latest committed artifact of each input stage (or the one pinned by fingerprint)."""
    ws = Workspace.from_config(cfg)
    refs = {}
    for name in stage_inputs(cfg, stage):
        fp = (pinned or {}).get(name)
        art = find_artifact(ws.store, ws.experiment, name, fp) if fp else latest_artifact(ws.store, ws.experiment, name)
        if art is None:
            what = f"fingerprint {fp}" if fp else "any committed artifact"
            raise MissingUpstream(
                f"stage {stage!r} needs {name!r} but {ws.store.url(ws.experiment + '/' + name)} has no {what}: "
                f"run `eightfold stage {name}` first"
            )
        refs[name] = ArtifactRef(name, art.fingerprint, art.uri, cached=True)
    return refs


def _local_inputs(ws: Workspace, inputs: dict[str, ArtifactRef]) -> dict[str, Path]:
    """Local folders of the inputs: the store's own folder for file://, a verified download otherwise."""
    out = {}
    for name, ref in inputs.items():
        art = find_artifact(ws.store, ws.experiment, ref.stage, ref.fingerprint)
        if art is None:
            raise MissingUpstream(f"input {name!r} ({ref.uri}) is not committed")
        if isinstance(ws.store, FileStore):
            out[name] = ws.store.local_path(art.prefix)
        else:
            out[name] = art.download(ws.path("cache", ref.stage, ref.fingerprint))
    return out


def _markdown(stage: str, art: Artifact, summary: dict, run_url: str | None, cached: bool) -> str:
    lines = [f"## {stage} {'(cached)' if cached else ''}", "", f"- artifact: `{art.uri}`",
             f"- fingerprint: `{art.fingerprint}`", f"- inputs: {', '.join(f'`{k}`={v}' for k, v in art.inputs.items()) or 'none'}"]
    if run_url:
        lines.append(f"- MLflow run: {run_url}")
    if summary:
        lines += ["", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in summary.items()
                  if isinstance(v, (int, float, str, bool))]
    return "\n".join(lines)


def execute_stage(
    cfg: LifecycleConfig,
    stage: str,
    inputs: dict[str, ArtifactRef],
    parent_run_id: str | None = None,
    force: bool = False,
    log=print,
    progress=None,
) -> ArtifactRef:
    """Run `stage` unless its artifact is already committed; commit its output; track it. While it
    builds, the stage's lease in the store (infra/lease.py) is held: another run on the same
    fingerprint waits for it and is then a cache hit, instead of building into the same folders."""
    spec = STAGES[stage]
    ws = Workspace.from_config(cfg)
    fp = stage_fingerprint(cfg, stage, inputs)
    existing = find_artifact(ws.store, ws.experiment, stage, fp)
    if existing is not None and not force:
        return _cache_hit(ws, stage, fp, existing, parent_run_id, log)
    lease = StoreLease(ws.store, lease_key(ws.experiment, stage, fp))
    waiting = False
    while not lease.try_acquire():
        if not force and (done := find_artifact(ws.store, ws.experiment, stage, fp)) is not None:
            return _cache_hit(ws, stage, fp, done, parent_run_id, log)
        if not waiting:
            holder = (lease.holder() or {}).get("owner", "another run")
            log(f"{stage}: {holder} is building this artifact (fingerprint {fp}); waiting for it")
            waiting = True
        time.sleep(LEASE_POLL_S)
    try:
        # committed by a run that held the lease after our first look (the one we waited for)
        existing = find_artifact(ws.store, ws.experiment, stage, fp)
        if existing is not None and not force:
            return _cache_hit(ws, stage, fp, existing, parent_run_id, log)
        return _build(cfg, stage, inputs, ws, fp, existing, parent_run_id, log, progress)
    finally:
        lease.release()


def _cache_hit(ws: Workspace, stage: str, fp: str, existing: Artifact, parent_run_id: str | None, log) -> ArtifactRef:
    """The committed artifact, and (under a lifecycle or stage-flow run) a nested MLflow run that says
    so: tagged cached, linking the run that built it, carrying its figures (Tracker.cached_stage_run)."""
    # the fingerprint covers config and inputs, not code: say when other code built the artifact
    built, now = existing.manifest.get("code_version"), code_version()
    stale = built not in (None, "unknown", now) and now != "unknown"
    log(f"{stage}: cached {existing.uri}" + (f" (built by code {built}, this is {now}: `--force {stage}` "
                                              "rebuilds it)" if stale else ""))
    if parent_run_id:
        Tracker.for_workspace(ws).cached_stage_run(stage, fp, parent_run_id, existing.manifest.get("mlflow_run_id"),
                                                   existing.uri)
    return ArtifactRef(stage, fp, existing.uri, cached=True, summary=existing.manifest.get("summary"))


def _build(cfg: LifecycleConfig, stage: str, inputs: dict[str, ArtifactRef], ws: Workspace, fp: str,
           existing: Artifact | None, parent_run_id: str | None, log, progress) -> ArtifactRef:
    spec = STAGES[stage]
    tracker = Tracker.for_workspace(ws)
    out_dir = ws.workdir / "staging" / stage / fp
    prefix = artifact_prefix(ws.experiment, stage, fp)
    started = time.time()
    # the run ends FAILED on any error from here on: params, the inputs' download, the commit too
    with tracker.run(f"{stage}-{fp[:8]}", parent_run_id=parent_run_id, tags={"stage": stage, "fingerprint": fp}) as run_id:
        tracker.log_params(run_id, flatten_params({"stage": spec.section(cfg)}))
        tracker.log_artifact_inputs(run_id, {k: (v.uri, v.fingerprint) for k, v in inputs.items()},
                                    context="training" if spec.trains else "input")
        if not spec.trains:
            shutil.rmtree(out_dir, ignore_errors=True)  # leftovers of a failed attempt are never committed
        # A training stage keeps its job's output in the store across attempts: the job resumes from its
        # latest committed checkpoint there (same fingerprint, same config), which is what a task retry is
        # for. A forced re-run of a committed one starts afresh: its job writes where the old artifact is.
        if spec.trains and existing is not None:
            ws.store.delete(prefix)
        out_dir.mkdir(parents=True, exist_ok=True)
        ctx = StageContext(
            cfg=cfg,
            workspace=ws,
            out_dir=out_dir,
            out_uri=ws.store.url(prefix),
            inputs=_local_inputs(ws, inputs),
            input_uris={k: v.uri for k, v in inputs.items()},
            run_id=run_id,
            log_metrics=lambda m, step=None: tracker.log_metrics(run_id, m, step=step),
            log_params=lambda p: tracker.log_params(run_id, flatten_params(p)),
            log_artifact=lambda path: tracker.log_artifact(run_id, str(path)),
            log_table=lambda data, name: tracker.log_table(run_id, data, name),
            log_figure=lambda fig, name: tracker.log_figure(run_id, fig, name),
            **({"report_progress": progress} if progress else {}),
        )
        log(f"{stage}: running (fingerprint {fp})")
        try:
            summary = spec.load()(ctx) or {}
            _maybe_inject_fault(stage)
        except BaseException:
            if not spec.trains:  # a failed attempt's output is never committed: gone now, not at the next attempt
                shutil.rmtree(out_dir, ignore_errors=True)
            raise
        numeric = {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numeric:
            # At the job's last step, so a training stage's final figures don't land at step 0 of its curves.
            tracker.log_metrics(run_id, numeric, step=int(numeric.get("steps", 0)))
        if spec.trains:
            from trainer.checkpoint import drop_uncommitted

            drop_uncommitted(ws.store, prefix)  # a killed attempt's half-written checkpoints are not part of it
        art = commit_artifact(
            ws.store, ws.experiment, stage, fp, out_dir, config=spec.section(cfg), with_store_files=spec.trains,
            inputs={k: v.fingerprint for k, v in inputs.items()}, started_at=started,
            extra={"summary": summary, "mlflow_run_id": run_id, "input_uris": {k: v.uri for k, v in inputs.items()}},
        )
        tracker.set_tags(run_id, {"artifact_uri": art.uri})
    shutil.rmtree(out_dir, ignore_errors=True)
    log(f"{stage}: committed {art.uri} in {time.time() - started:.1f}s")
    return ArtifactRef(stage, fp, art.uri, cached=False, summary=summary)


def _artifact_key(cfg: LifecycleConfig, stage: str) -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{cfg.name}-{stage}".lower()).strip("-")


def _publish(cfg: LifecycleConfig, ref: ArtifactRef) -> None:
    ws = Workspace.from_config(cfg)
    art = find_artifact(ws.store, ws.experiment, ref.stage, ref.fingerprint)
    if art is None:
        return
    run_id = art.manifest.get("mlflow_run_id")
    url = None
    if run_id and ws.tracking_uri.startswith("http"):
        url = Tracker.for_workspace(ws).run_url(run_id)
    elif run_id:
        url = f"run `{run_id}` in `{ws.tracking_uri}`"
    markdown = _markdown(ref.stage, art, ref.summary or {}, url, ref.cached)
    # A stage's own top-level markdown (data card, size table, evaluation table) goes in too.
    for name, meta in sorted(art.manifest.get("files", {}).items()):
        if "/" not in name and name.endswith(".md") and int(meta["size"]) <= 32_000:
            markdown += f"\n\n### {name}\n\n" + art.store.get_bytes(art.key(name)).decode("utf-8", "replace")
    key = _artifact_key(cfg, ref.stage)
    create_markdown_artifact(markdown=markdown, key=key, description=f"{ref.stage} artifact {ref.fingerprint}")
    # the figures as a table the UI sorts and compares across runs, the MLflow run as a link
    rows = [{"figure": k, "value": v} for k, v in (ref.summary or {}).items() if isinstance(v, (int, float, str, bool))]
    if rows:
        create_table_artifact(table=rows, key=f"{key}-figures", description=f"{ref.stage} figures ({ref.fingerprint})")
    if url and url.startswith("http"):
        create_link_artifact(link=url, link_text=f"{ref.stage} in MLflow", key=f"{key}-mlflow-run",
                             description=f"the MLflow run that built {ref.stage} {ref.fingerprint}")


@task(name="stage", cache_policy=NO_CACHE, retries=0)
def stage_task(cfg: LifecycleConfig, stage: str, inputs: dict[str, ArtifactRef], parent_run_id: str | None = None,
               force: bool = False) -> ArtifactRef | State:
    """The stage's artifact; a cache hit ends in a Completed state named `Cached`, as Prefect's own.
    A training stage that will run holds one of the launcher's job slots meanwhile (job_slots)."""
    logger = get_run_logger()
    slots = job_slots(cfg) if STAGES[stage].trains and (force or not is_committed(cfg, stage, inputs)) else None
    with _holding(slots, logger.info):
        ref = execute_stage(cfg, stage, inputs, parent_run_id=parent_run_id, force=force, log=logger.info,
                            progress=progress_artifact(_artifact_key(cfg, stage) + "-progress"))
    _publish(cfg, ref)
    if ref.cached:
        return Completed(name="Cached", message=f"{stage}: cache hit {ref.uri}", data=ref)
    return ref


def progress_artifact(key: str):
    """A StageContext.report_progress that keeps one Prefect progress artifact of this task run up to
    date (created at the first report): what the UI shows while a training job runs."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    made: list = []

    def report(fraction: float, line: str) -> None:
        percent = round(100.0 * min(1.0, max(0.0, fraction)), 1)
        if not made:
            made.append(create_progress_artifact(percent, key=key, description=line))
        else:
            update_progress_artifact(made[0], percent, description=line)

    return report


def job_slots(cfg: LifecycleConfig) -> tuple[str, int] | None:
    """The Prefect global concurrency limit a training task holds while its job runs, so flow runs do
    not launch more jobs at once than the devices take: one limit per launcher, `infra.max_concurrent_jobs`
    slots (default 1 on the local launcher, whose jobs share one machine's devices; none on Slurm and
    Kubernetes, whose schedulers queue jobs). The last config to run sets the limit's size."""
    limit = cfg.infra.max_concurrent_jobs
    if limit is None and cfg.infra.launcher == "local":
        limit = 1
    return None if limit is None else (f"eightfold-jobs-{cfg.infra.launcher}", limit)


@contextmanager
def _holding(slots: tuple[str, int] | None, log) -> Iterator[None]:
    if slots is None:
        yield
        return
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    name, limit = slots
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, limit)
    started = time.monotonic()
    with concurrency(name, occupy=1, strict=True):
        if (waited := time.monotonic() - started) > 1:
            log(f"waited {waited:.0f}s for a slot of the concurrency limit {name!r} ({limit} at once)")
        yield


# Failures a retry cannot mend: the stage ends at once instead of burning its retries.
FINAL_ERRORS = (MissingUpstream, DivergenceBudgetSpent)


def worth_retrying(task, task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry unless the failure says retrying cannot help."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - an unreadable result: keep the retry policy
        return True
    return not isinstance(exc, FINAL_ERRORS)


def submit_stage(cfg: LifecycleConfig, stage: str, inputs: dict[str, ArtifactRef], parent_run_id: str | None,
                 force: bool, retries: int | None = None) -> ArtifactRef:
    """Run the stage task with its own name, tags, timeout and retry policy: training stages retry
    `infra.retries` times with exponential backoff (each retry resumes the job from its latest committed
    checkpoint, or rolls it back after a divergence: stages/attempts.py); other stages do not retry.
    `infra.task_timeout_s` bounds each attempt (a timed-out attempt cancels its job and counts as failed)."""
    trains = STAGES[stage].trains
    if retries is None:
        retries = cfg.infra.retries if trains else 0
    delay = cfg.infra.retry_delay_s
    t = stage_task.with_options(
        name=f"{stage}",
        tags={"eightfold", f"stage:{stage}", "training" if trains else "no-training"},
        timeout_seconds=cfg.infra.task_timeout_s.get(stage),
        retries=retries,
        retry_delay_seconds=[delay * 2**i for i in range(retries)] if retries else 0,
        retry_condition_fn=worth_retrying,
    )
    state = t(cfg, stage, inputs, parent_run_id=parent_run_id, force=force, return_state=True)
    return state.result()  # raises what the last attempt raised


def as_dict(ref: Any) -> dict:
    return ref.__dict__ if isinstance(ref, ArtifactRef) else dict(ref)
