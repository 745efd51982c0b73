"""A job that finished its work but whose rank never leaves its interpreter's shutdown (stuck in C with
the GIL held, where the rank's own exit watchdog cannot run) must not time its task out: the stage sees
this launch's completed result.json, waits stages.pretrain.TEARDOWN_GRACE_S, cancels the job and counts
it as completed; the cancelled rank prints where it was stuck."""

from __future__ import annotations

import logging
import time

import psutil
import pytest

from faults_jobs import job, result
from infra.config import LifecycleConfig

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_a_completed_job_stuck_in_its_shutdown_is_cancelled_and_counts(byte_tokens, tmp_path, monkeypatch, caplog):
    import stages.pretrain as pretrain
    from infra.launch import get_launcher
    from stages.base import StageContext

    monkeypatch.setattr(pretrain, "PROGRESS_EVERY_S", 1.0)
    monkeypatch.setattr(pretrain, "TEARDOWN_GRACE_S", 3.0)
    spec = job(tmp_path, byte_tokens, "stuck", dp=2, steps=4, checkpoint={"every": 4},
               faults={"hang_rank": 0, "hang_step": 4, "hang_mode": "shutdown"})
    handle = get_launcher(LifecycleConfig.model_validate(spec.config)).submit(spec, spec.write(tmp_path / "stuck.yaml"))
    ctx = StageContext(cfg=None, workspace=None, out_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="stages.pretrain"):
        assert pretrain.wait_reporting_progress(ctx, spec, handle, timeout=240) == 0
    res = result(spec)
    assert res.status == "completed" and res.steps == 4 and res.written_by(spec)
    assert "still running 3 s later; cancelled them. Where they were:" in caplog.text
    assert "_block_holding_the_gil" in caplog.text, caplog.text  # the stack it printed when it was terminated
    assert "rank 0 hangs after step 4 (shutdown)" in handle.log_path.read_text(errors="replace")
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in handle.pids):
        assert time.monotonic() < deadline, "the cancelled job's agents are still running"
        time.sleep(0.2)


def test_an_earlier_jobs_result_is_not_taken_for_this_ones(tmp_path):
    """A forced re-run writes into an output that may hold the last run's completed result.json; only
    this job's own launch counts."""
    from infra.launch.base import write_result
    from infra.launch.job import JobResult, JobSpec
    from stages.pretrain import _completed

    spec = JobSpec(job_id="new", stage="pretrain", config={}, output=str(tmp_path / "out"), workdir=str(tmp_path / "w"))
    assert not _completed(spec)
    write_result(spec.model_copy(update={"job_id": "old"}), JobResult(status="completed"))
    assert not _completed(spec)
    write_result(spec.model_copy(update={"attempt": 1}), JobResult(status="completed"))
    assert not _completed(spec)
    write_result(spec, JobResult(status="failed"))
    assert not _completed(spec)
    write_result(spec, JobResult(status="completed"))
    assert _completed(spec)
