"""The stage task as a Prefect user sees it: tags per stage, a cache hit that ends in a `Cached`
state (Completed, like Prefect's own cache hits), and `infra.task_timeout_s` bounding an attempt."""

from __future__ import annotations

import json
import threading
import time

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey, FlowRunFilter,
                                            FlowRunFilterId)
from prefect.runtime import flow_run

import tasks.stage as stage_module
from infra.config import ConfigError, load_config
from infra.config.infra import TASKS
from stages.registry import STAGES
from tasks.stage import submit_stage

pytestmark = pytest.mark.slow


@flow(name="one-stage-test")
def one_stage(cfg, stage: str) -> tuple[dict, str]:
    ref = submit_stage(cfg, stage, {}, parent_run_id=None, force=False)
    return dict(ref.__dict__), str(flow_run.id)


def _micro(tmp_path, *overrides):
    return load_config("micro", [f"infra.workdir={tmp_path / 'work'}",
                                 f"infra.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *overrides])


def _task_runs(flow_run_id: str):
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def test_a_cache_hit_is_a_cached_state_and_tasks_carry_their_stage_tags(tmp_path, prefect_harness):
    cfg = _micro(tmp_path)
    first, first_run = one_stage(cfg, "data")
    second, second_run = one_stage(cfg, "data")
    assert not first["cached"] and second["cached"] and second["fingerprint"] == first["fingerprint"]
    (ran,), (hit,) = _task_runs(first_run), _task_runs(second_run)
    assert ran.state.name == "Completed" and hit.state.name == "Cached" and hit.state.type.value == "COMPLETED"
    assert first["uri"] in hit.state.message
    assert {"eightfold", "stage:data", "no-training"} <= set(ran.tags)
    with get_client(sync_client=True) as client:  # the stage's figures as a table artifact too
        # this flow run's: the session's Prefect server also holds earlier lifecycles' micro-data-figures
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["micro-data-figures"]), flow_run_id=ArtifactFilterFlowRunId(any_=[first_run])))
    rows = {row["figure"]: row["value"] for row in json.loads(tables[0].data)}
    assert tables[0].type == "table" and rows and rows.items() <= first["summary"].items()


def test_a_task_past_its_timeout_fails_and_says_so(tmp_path, prefect_harness, monkeypatch):
    def hangs(*args, **kwargs):
        while True:
            time.sleep(0.1)

    monkeypatch.setattr(stage_module, "execute_stage", hangs)
    cfg = _micro(tmp_path, "infra.task_timeout_s={data: 1}")
    start = time.monotonic()
    with pytest.raises(Exception, match="timed out"):
        one_stage(cfg, "data")
    assert time.monotonic() - start < 60


def test_task_timeouts_name_tasks_that_exist():
    assert TASKS == tuple(STAGES)  # the config's list of task names is the registry's
    with pytest.raises(ConfigError, match="task_timeout_s names 'pretrian', not a task"):
        load_config("micro", ["infra.task_timeout_s={pretrian: 60}"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config("micro", ["infra.task_timeout_s={pretrain: 0}"])


@pytest.mark.parametrize("limit", [1, 2])
def test_training_tasks_hold_a_slot_of_the_launchers_job_limit(tmp_path, prefect_harness, monkeypatch, limit):
    """Two flow runs start pretrain at once. Each task, once in, waits for the other to come in too:
    with infra.max_concurrent_jobs=2 it does; with 1 it cannot (the first gives up after 3 s and
    leaves, then the second comes in alone). No timing decides which: only the slots."""
    from tasks.stage import ArtifactRef

    lock, inside, most = threading.Lock(), [0], [0]

    def trains(cfg, stage, inputs, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        give_up = time.monotonic() + (120 if limit == 2 else 3)
        while most[0] < 2 and time.monotonic() < give_up:
            time.sleep(0.05)
        with lock:
            inside[0] -= 1
        return ArtifactRef(stage, "f" * 16, "file:///nowhere", cached=False, summary={})

    monkeypatch.setattr(stage_module, "execute_stage", trains)
    monkeypatch.setattr(stage_module, "is_committed", lambda *a: False)
    monkeypatch.setattr(stage_module, "_publish", lambda *a: None)
    cfg = _micro(tmp_path, f"infra.max_concurrent_jobs={limit}")
    assert stage_module.job_slots(cfg) == ("eightfold-jobs-local", limit)
    threads = [threading.Thread(target=one_stage, args=(cfg, "pretrain")) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == limit


def test_job_slots_default_to_one_on_the_local_launcher_only(tmp_path):
    assert stage_module.job_slots(_micro(tmp_path)) == ("eightfold-jobs-local", 1)
    assert stage_module.job_slots(_micro(tmp_path, "infra.launcher=slurm")) is None
    assert stage_module.job_slots(_micro(tmp_path, "infra.launcher=slurm", "infra.max_concurrent_jobs=4")) == (
        "eightfold-jobs-slurm", 4)


def test_progress_reports_keep_one_progress_artifact_up_to_date(prefect_harness):
    @flow(name="progress-test")
    def reports() -> str:
        report = stage_module.progress_artifact("micro-pretrain-progress")
        report(0.25, "step 5/20")
        report(0.5, "step 10/20")
        return str(flow_run.id)

    run_id = reports()
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["micro-pretrain-progress"]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    assert [(a.type, float(a.data), a.description) for a in found] == [("progress", 50.0, "step 10/20")]
