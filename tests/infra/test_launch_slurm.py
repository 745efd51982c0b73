"""The Slurm launcher: the rendered sbatch script, and real jobs on the local single-node Slurm
(the `slurm_cluster` fixture starts it with infra/slurm/start.sh)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from infra.config import LifecycleConfig
from infra.config.launch import SlurmConfig
from infra.launch.base import JobHandle, Launcher
from infra.launch.job import JobSpec
from infra.launch.slurm import (
    SlurmError,
    SlurmLauncher,
    exit_code_of,
    parse_job_record,
    read_exclude_file,
    record_bad_nodes,
)

TESTS = Path(__file__).resolve().parents[1]

if "fixtures.slurm" not in sys.modules:  # until tests/conftest.py registers it in pytest_plugins
    from fixtures.slurm import slurm_cluster  # noqa: F401


def _spec(tmp_path: Path, job_id: str, mode: str, nproc: int = 2) -> tuple[JobSpec, Path]:
    cfg = LifecycleConfig.model_validate({"parallel": {"nproc_per_node": nproc, "dp": nproc}})
    spec = JobSpec(
        job_id=job_id,
        stage="pretrain",
        config=cfg.model_dump(mode="json"),
        output=f"file://{tmp_path / 'out' / job_id}",
        workdir=str(tmp_path / "work" / job_id),
        env={"EIGHTFOLD_TEST_MODE": mode},
    )
    return spec, spec.write(tmp_path / "work" / job_id / "job.yaml")


def _launcher(**config) -> SlurmLauncher:
    # The worker module lives in tests/fixtures; the script puts the repo root first on PYTHONPATH.
    cfg = SlurmConfig(time_limit="5", poll_interval_s=0.2, **config)
    return SlurmLauncher(cfg, module="fixtures.launch_worker", env={"PYTHONPATH": str(TESTS)})


# --- the script, without a cluster ---------------------------------------------------------------


def test_script_has_shape_resources_exclusions_and_rendezvous(tmp_path):
    spec, job_file = _spec(tmp_path, "render", "allreduce", nproc=4)
    spec.config["parallel"]["nnodes"] = 2  # a 2-node job of 4 ranks each
    record_bad_nodes(tmp_path / "exclude.txt", ["gpu-17", "gpu-03"], reason="nccl all_reduce 40% slow")
    launcher = SlurmLauncher(
        SlurmConfig(
            partition="h100", account="llm", time_limit="2-00:00:00", gpus_per_node=8, cpus_per_task=96,
            exclude=["gpu-01"], extra_args=["--constraint=ib"], setup=["source /opt/venv/bin/activate"],
        ),
        exclude_file=tmp_path / "exclude.txt",
    )
    script = launcher.render(spec, job_file)
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=eightfold-render",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=96",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=h100",
        "#SBATCH --account=llm",
        "#SBATCH --exclude=gpu-01,gpu-17,gpu-03",
        f"#SBATCH --output={Path(spec.workdir).resolve() / 'logs' / 'render.log'}",
        "#SBATCH --open-mode=append",
        "#SBATCH --constraint=ib",
    ]
    assert "source /opt/venv/bin/activate" in script
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    one_line = " ".join(script.replace("\\\n", " ").split())
    assert "srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --cpus-per-task=96 --kill-on-bad-exit=1" in one_line
    assert (
        '-m torch.distributed.run --nnodes="$SLURM_NNODES" --nproc-per-node=4 --rdzv-backend=c10d '
        '--rdzv-endpoint="$head_addr:$rdzv_port" --rdzv-id="$SLURM_JOB_ID"'
    ) in one_line
    assert one_line.endswith(f"-m trainer {job_file.resolve()}")
    assert "export EIGHTFOLD_TEST_MODE=allreduce" in script


def test_script_probes_every_node_before_torchrun_unless_health_checks_are_off(tmp_path):
    spec, job_file = _spec(tmp_path, "health", "allreduce", nproc=1)
    one_line = " ".join(SlurmLauncher(SlurmConfig(node_health_timeout_s=90)).render(spec, job_file)
                        .replace("\\\n", " ").split())
    probe = (f'timeout 90 srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0 {sys.executable} '
             f"-m infra.node_health probe {job_file.resolve()} || true")
    verdict = f"-m infra.node_health verdict {job_file.resolve()} --nodes="
    assert probe in one_line and verdict in one_line
    assert one_line.index(probe) < one_line.index(verdict) < one_line.index("-m torch.distributed.run")
    assert "|| exit $?" in one_line.split(verdict, 1)[1]  # a bad node ends the script before training
    off = SlurmLauncher(SlurmConfig(node_health=False)).render(spec, job_file)
    spec.config["infra"]["health_check"] = False
    also_off = SlurmLauncher(SlurmConfig()).render(spec, job_file)
    assert "node_health" not in off and "node_health" not in also_off and "torch.distributed.run" in off


def test_exclude_file_and_config_errors(tmp_path):
    path = tmp_path / "bad.txt"
    record_bad_nodes(path, ["n1", "n2"], reason="health")
    record_bad_nodes(path, ["n2", "n3"])
    assert read_exclude_file(path) == ["n1", "n2", "n3"]
    assert read_exclude_file(tmp_path / "missing.txt") == []
    with pytest.raises(ValidationError, match="time_limit '2 days' is not a Slurm time"):
        SlurmConfig(time_limit="2 days")
    with pytest.raises(ValidationError, match="one node name"):
        SlurmConfig(exclude=["a,b"])
    with pytest.raises(ValidationError, match="one sbatch option"):
        SlurmConfig(extra_args=["constraint=ib"])


def test_scontrol_record_and_exit_codes():
    line = (
        "JobId=7 JobName=eightfold-x UserId=root(0) JobState=CANCELLED Reason=None ExitCode=0:15 "
        "NodeList=vm Command=/tmp/a b=c/job.sbatch WorkDir=/tmp/x"
    )
    rec = parse_job_record(line)
    assert (rec["JobState"], rec["ExitCode"], rec["NodeList"]) == ("CANCELLED", "0:15", "vm")
    assert [exit_code_of(x) for x in ("0:0", "3:0", "0:15", "1:9")] == [0, 3, 143, 1]


# --- real jobs on the local Slurm -----------------------------------------------------------------


def _pids(workdir: Path) -> list[int]:
    """Every rank's pid and its torchrun agent's pid, as the worker recorded them."""
    out = []
    for f in sorted((workdir / "pids").glob("rank*")):
        out += [int(x) for x in f.read_text().split()]
    return out


def _job_processes(job_file: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if str(job_file) in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.mark.distributed
def test_torchrun_job_all_reduces_over_two_ranks(slurm_cluster, tmp_path):
    spec, job_file = _spec(tmp_path, "allreduce", "allreduce", nproc=2)
    launcher = _launcher()
    assert isinstance(launcher, Launcher)
    job = launcher.submit(spec, job_file)
    assert isinstance(job, JobHandle) and job.slurm_id.isdigit()
    assert job.wait(timeout=90) == 0, job.log_path.read_text()
    assert job.poll() == "succeeded" and job.slurm_state == "COMPLETED"
    result = launcher.result(spec)
    assert result is not None and result.status == "completed"
    # gloo all_reduce of rank+1 over the ranks == 1 + 2 + ... + world, counted here independently.
    world = 2
    assert result.metrics["world_size"] == world
    assert result.metrics["all_reduce_sum"] == sum(range(1, world + 1))
    assert result.slurm_job_id == job.slurm_id  # it really ran as this Slurm job
    assert result.hostname == socket.gethostname()
    log = job.log_path.read_text()
    assert f"slurm job {job.slurm_id} on" in log and "rank 1/2" in log


@pytest.mark.distributed
def test_cancel_ends_every_process_of_the_job(slurm_cluster, tmp_path):
    spec, job_file = _spec(tmp_path, "sleeper", "sleep", nproc=2)
    job = _launcher().submit(spec, job_file)
    deadline = time.monotonic() + 60
    while len(list((Path(spec.workdir) / "pids").glob("rank*"))) < 2:
        assert job.poll() in ("pending", "running"), job.log_path.read_text() if job.log_path.exists() else ""
        assert time.monotonic() < deadline, "the ranks did not start within 60 s"
        time.sleep(0.2)
    pids = _pids(Path(spec.workdir))
    assert job.poll() == "running" and all(psutil.pid_exists(p) for p in pids)
    job.cancel()
    assert job.poll() == "cancelled" and job.slurm_state == "CANCELLED"
    survivors = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert survivors == [], f"ranks/agents still alive after scancel: {survivors}"
    assert _job_processes(job_file.resolve()) == []
    assert job.wait(timeout=5) != 0


@pytest.mark.distributed
def test_failing_job_reports_failed(slurm_cluster, tmp_path):
    spec, job_file = _spec(tmp_path, "failing", "fail", nproc=2)
    launcher = _launcher()
    job = launcher.submit(spec, job_file)
    code = job.wait(timeout=90)
    assert code != 0 and job.poll() == "failed" and job.slurm_state == "FAILED"
    assert launcher.result(spec) is None  # it wrote no result.json


def test_excluding_every_node_is_refused_by_slurm(slurm_cluster, tmp_path):
    spec, job_file = _spec(tmp_path, "excluded", "allreduce", nproc=1)
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()
    assert nodes, "sinfo lists no node"
    record_bad_nodes(tmp_path / "exclude.txt", sorted(set(nodes)), reason="failed health check")
    launcher = SlurmLauncher(SlurmConfig(time_limit="1"), exclude_file=tmp_path / "exclude.txt")
    with pytest.raises(SlurmError, match="node configuration is not available"):
        launcher.submit(spec, job_file)
