"""A node that fails the in-job pre-flight (trainer/health.py) is named in the error, reported under the
job's work dir, and kept out of later Slurm submits by the launching stage (stages/pretrain.py), so the
task's retry runs on other nodes (seed: "Teams run health checks between jobs, keep spare nodes ready")."""

from __future__ import annotations

import socket

import pytest
import torch

from infra.launch.job import JobSpec
from infra.launch.local import LocalLauncher
from infra.launch.slurm import SlurmLauncher
from stages.pretrain import _bad_nodes, _exclude_bad_nodes
from trainer.health import PreflightFailed, preflight, read_bad_nodes


def test_a_failed_preflight_names_the_node_and_slurm_excludes_it(tmp_path):
    work = tmp_path / "job"
    assert read_bad_nodes(work) == {}
    with pytest.raises(PreflightFailed, match=f"rank 0 on node {socket.gethostname()} pre-flight failed: disk"):
        preflight(torch.device("cpu"), work, None, rank=0, min_free_gb=1e12)  # no disk is that large
    bad = read_bad_nodes(work)
    assert list(bad) == [socket.gethostname()] and "disk" in bad[socket.gethostname()]

    spec = JobSpec(job_id="pretrain-1", stage="pretrain", config={}, inputs={}, output=str(tmp_path / "out"),
                   workdir=str(work))
    slurm = SlurmLauncher(exclude_file=tmp_path / "exclude-nodes.txt")
    assert _bad_nodes(spec) == bad
    event = _exclude_bad_nodes(slurm, spec, bad)
    assert socket.gethostname() in event and "excluded from later submits" in event
    assert slurm.excluded_nodes() == [socket.gethostname()]  # what the next sbatch --exclude gets
    _exclude_bad_nodes(slurm, spec, bad)  # reported again: listed once
    assert slurm.excluded_nodes() == [socket.gethostname()]
    assert "nothing to exclude" in _exclude_bad_nodes(LocalLauncher(nproc_per_node=1), spec, bad)
