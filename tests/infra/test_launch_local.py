"""The local launcher: a 2-rank torchrun job end to end, a failing rank, and cancelling with no
process left behind."""

from __future__ import annotations

import os
import time

import psutil
import pytest
from mlflow import MlflowClient

from infra.config import load_config
from infra.launch import JobSpec, TrackingRef, get_launcher
from infra.launch.local import LocalLauncher
from infra.tracking import Tracker

pytestmark = pytest.mark.distributed
PROBE = "tests.infra.jobs.probe"


def _spec(tmp_path, mode: str, **kw) -> tuple[JobSpec, object]:
    cfg = load_config("tiny")
    spec = JobSpec(
        job_id=f"probe-{mode}",
        stage="pretrain",
        config=cfg.model_dump(mode="json"),
        output=(tmp_path / "out").as_uri(),
        workdir=str(tmp_path / "work"),
        env={"EIGHTFOLD_TEST_JOB_MODE": mode},
        **kw,
    )
    return spec, spec.write(tmp_path / "work" / "job.yaml")


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_two_rank_allreduce_job(tmp_path, capsys):
    uri = os.environ["MLFLOW_TRACKING_URI"]  # the session's sqlite file (tests/conftest.py)
    tracker = Tracker(uri, f"launch-{tmp_path.name}")
    run_id = tracker.start_run("pretrain")
    ref = TrackingRef(uri=uri, experiment=tracker.experiment, run_id=run_id)
    spec, job_file = _spec(tmp_path, "allreduce", tracking=ref)
    launcher = LocalLauncher(nproc_per_node=2, module=PROBE, env={"EIGHTFOLD_DEVICE": "cpu"}, echo=True)
    assert launcher.result(spec) is None  # nothing written yet

    job = launcher.submit(spec, job_file)
    assert job.wait(timeout=120) == 0, job.log_path.read_text()
    assert job.poll() == "succeeded"

    result = launcher.result(spec)
    assert result is not None and result.status == "completed"
    assert result.metrics == {"allreduce_sum": 3.0, "world_size": 2.0}  # 1 + 2 from ranks 0 and 1
    log = "".join(job.logs())
    assert "rank 0/2 mode allreduce device cpu" in log and "rank 1/2 mode allreduce device cpu" in log
    assert job.log_path == tmp_path / "work" / "logs" / "probe-allreduce.log"
    assert "".join(job.logs(follow=True)) == log  # a finished job: follow ends at the last line
    assert "[probe-allreduce] rank 1/2 mode allreduce device cpu" in capsys.readouterr().out  # echoed
    # Rank 0 in another process logged into the run we created here, by id.
    history = MlflowClient(uri).get_metric_history(run_id, "allreduce_sum")
    assert [(m.step, m.value) for m in history] == [(1, 3.0)]


def test_failing_rank_fails_the_job(tmp_path):
    spec, job_file = _spec(tmp_path, "fail")
    job = LocalLauncher(nproc_per_node=2, module=PROBE).submit(spec, job_file)
    start = time.monotonic()
    code = job.wait(timeout=100)
    assert code != 0 and job.poll() == "failed"
    assert time.monotonic() - start < 60  # rank 0 sleeps 120 s: torchrun ended it when rank 1 failed
    assert "rank 1 failing on purpose" in job.log_path.read_text()
    assert LocalLauncher(1, module=PROBE).result(spec) is None


def test_cancel_leaves_no_process(tmp_path):
    spec, job_file = _spec(tmp_path, "sleep")
    job = LocalLauncher(nproc_per_node=2, module=PROBE).submit(spec, job_file)
    pids = tmp_path / "work" / "pids"
    deadline = time.monotonic() + 90
    while len(list(pids.glob("rank*.pid"))) < 2:
        assert job.poll() == "running", job.log_path.read_text()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    with pytest.raises(TimeoutError, match="still running"):
        job.wait(timeout=0.2)
    agent = psutil.Process(job.pids[0])
    family = [agent, *agent.children(recursive=True)]
    rank_pids = {int(p.read_text()) for p in pids.glob("rank*.pid")}
    assert rank_pids <= {p.pid for p in family}  # the ranks are the agent's descendants

    start = time.monotonic()
    job.cancel(grace_s=3)  # rank 1 ignores SIGTERM: only SIGKILL after the grace period ends it
    took = time.monotonic() - start
    assert job.poll() == "cancelled"
    survivors = [p for p in family if not _gone(p)]
    assert not survivors, f"still running: {[(p.pid, p.name()) for p in survivors]}"
    assert 2.5 < took < 15


def test_get_launcher_from_config():
    cfg = load_config("tiny", ["parallel.nproc_per_node=2", "parallel.dp=2", "infra.device=cpu"])
    launcher = get_launcher(cfg)
    assert isinstance(launcher, LocalLauncher)
    assert (launcher.nproc_per_node, launcher.nnodes, launcher.module) == (2, 1, "trainer")
    assert launcher.env["EIGHTFOLD_DEVICE"] == "cpu"
    cmd = launcher.command("job.yaml")
    assert cmd[1:] == [
        "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "2", "--max-restarts", "0", "-m", "trainer", "job.yaml",
    ]  # fmt: skip
    from infra.launch.slurm import SlurmLauncher

    assert isinstance(get_launcher(load_config("tiny", ["infra.launcher=slurm"])), SlurmLauncher)


def test_two_local_nodes_static_rendezvous(tmp_path):
    """nnodes=2 on one machine: two torchrun agents meet on 127.0.0.1, one rank each."""
    spec, job_file = _spec(tmp_path, "allreduce")
    launcher = LocalLauncher(nproc_per_node=1, nnodes=2, module=PROBE)
    job = launcher.submit(spec, job_file)
    assert job.wait(timeout=120) == 0, job.log_path.read_text()
    assert launcher.result(spec).metrics == {"allreduce_sum": 3.0, "world_size": 2.0}


def test_a_failed_node_ends_the_job_on_every_node(tmp_path):
    """Node 1's rank exits 3 while node 0's would sleep 120 s: node 0's agent cannot know (the
    rendezvous is over), so the launcher ends it, as Slurm's --kill-on-bad-exit does."""
    spec, job_file = _spec(tmp_path, "fail")
    job = LocalLauncher(nproc_per_node=1, nnodes=2, module=PROBE).submit(spec, job_file)
    deadline = time.monotonic() + 90
    while "rank 0/2 mode fail" not in (job.log_path.read_text() if job.log_path.exists() else ""):
        assert time.monotonic() < deadline, "rank 0 did not start"
        time.sleep(0.2)
    agent = psutil.Process(job.pids[0])
    node0 = [agent, *agent.children(recursive=True)]
    start = time.monotonic()
    assert job.wait(timeout=100) not in (0, None)
    assert time.monotonic() - start < 60, "node 0 slept on after node 1 failed"
    assert job.poll() == "failed"
    assert "rank 1 failing on purpose" in job.log_path.read_text()
    survivors = [p for p in node0 if not _gone(p)]
    assert not survivors, f"still running: {[(p.pid, p.name()) for p in survivors]}"
