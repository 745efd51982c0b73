"""Attempts of one training job into one output folder, across the task's retries.

A training stage keeps its output folder between task retries, so each launch resumes from the job's
latest committed checkpoint. This module remembers what the earlier launches did (`attempts.json`
beside the checkpoints, committed with the artifact) and turns it into the next launch's job file:

- a `failed` job (a killed or hung rank, a lost node) is simply relaunched: it resumes from the
  latest committed checkpoint;
- a `diverged` job (the trainer's own skips and rollbacks did not help) is rolled back one checkpoint
  further: the newest committed one is dropped, the next launch resumes from the one before, skips the
  data windows that spiked and runs at `spike.task_lr_factor` times the LR per divergence so far;
  after `spike.task_rollbacks` such rollbacks the stage ends with DivergenceBudgetSpent, which the
  task does not retry.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from infra.config.train import SpikeConfig
from infra.launch.base import endpoint_for
from infra.launch.job import JobResult, JobSpec
from infra.store import open_store

ATTEMPTS = "attempts.json"


class TrainingJobFailed(RuntimeError):
    """The training job ended without `completed`; the message names its log and result. Retried."""


class TrainingDiverged(TrainingJobFailed):
    """The job diverged and its output was rolled back one checkpoint; a retry resumes from there."""


class DivergenceBudgetSpent(TrainingJobFailed):
    """The job diverged after `spike.task_rollbacks` task-level rollbacks: retrying would not help."""


def _store(spec: JobSpec):
    return open_store(spec.output, endpoint_url=endpoint_for(spec))


def read_attempts(spec: JobSpec) -> list[dict[str, Any]]:
    """The earlier launches' records, from the job's output in the store."""
    store = _store(spec)
    return store.get_json(ATTEMPTS) if store.exists(ATTEMPTS) else []


def _write_attempts(spec: JobSpec, attempts: list[dict[str, Any]]) -> None:
    _store(spec).put_json(attempts, ATTEMPTS)


def next_launch(spec: JobSpec, spike: SpikeConfig, log: Callable[[str], None] = print) -> JobSpec:
    """The job file of the next launch: its attempt number, the LR cap after the divergences so far,
    every data window an earlier attempt found spiking and, with `infra.elastic`, the nodes left after
    those found bad. Clears an earlier attempt's result.json."""
    attempts = read_attempts(spec)
    if attempts:  # a killed job writes no result.json: never read the previous attempt's as this one's
        _store(spec).delete("result.json")
    diverged = sum(1 for a in attempts if a["status"] == "diverged")
    windows = sorted({tuple(w) for a in attempts for w in a.get("skip_windows", [])})
    lost = sorted({n for a in attempts for n in a.get("bad_nodes", [])})
    config = spec.config
    if lost and (spec.config.get("infra") or {}).get("elastic"):
        config = _without_nodes(spec, len(lost), log)
    return spec.model_copy(update={"attempt": len(attempts), "lr_scale": spike.task_lr_factor ** diverged,
                                   "skip_windows": [list(w) for w in windows], "config": config,
                                   "previous_attempt_ended_at": attempts[-1]["ended_at"] if attempts else None})


def _without_nodes(spec: JobSpec, lost: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The job's config on `lost` fewer nodes: data parallelism shrinks with the world (the checkpoint
    reshards: trainer.checkpoint), the global batch stays. The config unchanged, and why, when the
    mesh cannot shrink that way (no node left; pp x cp x tp not dividing what is left; the batch)."""
    from pydantic import ValidationError

    from infra.config import LifecycleConfig

    par = spec.config["parallel"]
    nodes = par["nnodes"] - lost
    inner = par.get("pp", 1) * par.get("cp", 1) * par.get("tp", 1)
    world = nodes * par["nproc_per_node"]
    why = ""
    if nodes < 1:
        why = "no node left"
    elif world % inner:
        why = f"{world} ranks are not a multiple of pp*cp*tp = {inner}"
    else:
        config = {**spec.config, "parallel": {**par, "nnodes": nodes, "dp": world // inner}}
        try:
            LifecycleConfig.model_validate(config)
        except ValidationError as err:
            why = str(err).splitlines()[0]
        else:
            log(f"{spec.stage}: elastic: {lost} node(s) lost; the next launch runs on {nodes} node(s), "
                f"dp {par['dp']} -> {world // inner}")
            return config
    log(f"{spec.stage}: elastic: cannot drop {lost} node(s) ({why}); relaunching on {par['nnodes']}")
    return spec.config


def settle(spec: JobSpec, result: JobResult | None, exit_code: int, spike: SpikeConfig,
           log: Callable[[str], None] = print, bad_nodes: list[str] | None = None) -> dict[str, Any]:
    """Record how this launch ended (and the nodes its health checks found bad); after a divergence,
    roll the output back one checkpoint (or say the budget is spent). Returns the attempt's record (its
    `event` says what was done)."""
    attempts = read_attempts(spec)
    status = result.status if result else "failed"
    record: dict[str, Any] = {"attempt": spec.attempt, "status": status, "exit_code": exit_code,
                              "nodes": spec.config.get("parallel", {}).get("nnodes", 1), "bad_nodes": bad_nodes or [],
                              "steps": result.steps if result else None, "lr_scale": spec.lr_scale,
                              "checkpoint": result.checkpoint if result else None, "ended_at": time.time(),
                              "skip_windows": result.skip_windows if result else [], "event": "none"}
    if status == "failed":
        record["event"] = "retry from the latest committed checkpoint"
    elif status == "diverged":
        diverged = 1 + sum(1 for a in attempts if a["status"] == "diverged")
        if diverged > spike.task_rollbacks:
            record["event"] = f"diverged {diverged} times (spike.task_rollbacks={spike.task_rollbacks}): giving up"
        else:
            from trainer.checkpoint import committed_steps, uncommit

            store = _store(spec)
            steps = committed_steps(store)
            if steps:
                uncommit(store, steps[0])
            resume = steps[1] if len(steps) > 1 else 0
            record.update(event=f"rolled back: dropped checkpoint {steps[0] if steps else None}, resume from step "
                                f"{resume} at lr scale {spike.task_lr_factor ** diverged:g}",
                          dropped_step=steps[0] if steps else None, resume_step=resume,
                          next_lr_scale=spike.task_lr_factor ** diverged)
    attempts.append(record)
    _write_attempts(spec, attempts)
    if status != "completed":
        log(f"{spec.stage}: attempt {spec.attempt} ended {status}: {record['event']}")
    return record
