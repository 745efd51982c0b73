"""Every process group gets parallel.collective_timeout_s (trainer/parallel/mesh.py): the mesh's
dimensions, a flattened dimension, the expert-parallel groups and the checkpoint's gloo group, not
torch's backend default (30 min on gloo). Four gloo ranks under torchrun (group_timeout_worker.py):
a collective with one member that never joins fails after the configured 5 s. Also the arguments
init_process_group gets on CUDA (device_id), checked without a GPU."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from infra.config import LifecycleConfig
from infra.config.parallel import ParallelConfig
from trainer.parallel.mesh import collective_timeout, process_group_args

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
TIMEOUT_S = 5  # group_timeout_worker.TIMEOUT_S


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("group_timeouts")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(HERE / "group_timeout_worker.py"), str(out)]
    # torch's default group timeout would hold the hung collectives for 30 minutes: bounded here.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


@pytest.mark.distributed
def test_every_group_has_the_configured_timeout(reports):
    for rank, report in reports.items():
        groups = ("default", "tp", "dp", "checkpoint", "ep", "flattened")
        assert report["timeouts"] == {g: TIMEOUT_S for g in groups}, rank


@pytest.mark.distributed
def test_a_rank_that_never_joins_fails_its_peers_after_the_timeout(reports):
    # 2x2 mesh (dp outer, tp inner): tp groups {0,1} {2,3}, dp groups {0,2} {1,3}; checkpoint group: all.
    hung = {"tp": [0], "dp": [0], "checkpoint": [0, 1, 2]}
    fine = {"tp": [2, 3], "dp": [1, 3], "checkpoint": []}
    for phase in hung:
        results = [reports[rank]["phases"][phase] for rank in hung[phase]]
        # The first member to time out closes its connections, so the others may fail on that.
        assert any("timed out" in r["error"].lower() for r in results), (phase, results)
        for r in results:
            error = r["error"].lower()
            assert not r["ok"] and ("timed out" in error or "closed by peer" in error), (phase, r)
            # Every member waited the configured timeout, not torch's 30 min nor our own 60 s CPU
            # default; the upper margin covers a loaded 2-core machine.
            assert 0.9 * TIMEOUT_S <= r["seconds"] < 4 * TIMEOUT_S, (phase, r)
        for rank in fine[phase]:
            assert reports[rank]["phases"][phase]["ok"], (phase, rank)


def test_process_group_args_bind_the_gpu_on_cuda(monkeypatch):
    par = ParallelConfig(nproc_per_node=2, dp=2, collective_timeout_s=7)
    assert process_group_args(par, "nccl", torch.device("cuda", 3)) == {
        "backend": "nccl", "timeout": timedelta(seconds=7), "device_id": torch.device("cuda", 3)}
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert process_group_args(par, "nccl", torch.device("cuda"))["device_id"] == torch.device("cuda", 1)
    assert process_group_args(par, "gloo", torch.device("cpu")) == {"backend": "gloo", "timeout": timedelta(seconds=7)}
    assert collective_timeout(ParallelConfig(), "cuda") == timedelta(seconds=600)
    assert collective_timeout(ParallelConfig(), "cpu") == timedelta(seconds=60)


def test_init_distributed_passes_them_to_init_process_group(monkeypatch):
    """The CUDA path of trainer.process_group.init_distributed, run without a GPU: what init_process_group gets."""
    import trainer.process_group as process_group

    calls = []
    monkeypatch.setattr(process_group, "pick_device", lambda backend, device: (torch.device("cuda", 1), "nccl"))
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(process_group.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(process_group, "attempt_store", lambda timeout: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = LifecycleConfig.model_validate({"parallel": {"nproc_per_node": 2, "dp": 2, "collective_timeout_s": 9}})
    process_group.init_distributed(cfg)
    assert calls == [{"backend": "nccl", "timeout": timedelta(seconds=9), "device_id": torch.device("cuda", 1)}]
