"""Data parallel over 2 gloo ranks gives the same losses and weights as one process on the same
global batch (fp32), with gradient accumulation (no_sync) and small buckets (several all-reduces)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.trainer_data import tiny_config
from infra.launch.job import JobSpec

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trainer_ddp_worker.py")


def job(tmp: Path, tokens: Path, name: str, dp: int, moe: dict | None) -> Path:
    cfg = tiny_config(steps=4, micro_batch_size=2, global_batch_size=8, lr=3e-3, warmup_steps=1)
    d = cfg.model_dump(mode="json")
    d["parallel"].update(dp=dp, nproc_per_node=dp, bucket_mb=0.02)  # ~5k floats a bucket: several buckets
    if moe:
        d["model"]["moe"] = moe
    spec = JobSpec(job_id=name, stage="pretrain", config=d, inputs={"tokens": str(tokens)},
                   output=str(tmp / name / "out"), workdir=str(tmp / name / "work"))
    return spec.write(tmp / f"{name}.yaml")


def launch(job_file: Path, out: Path, nproc: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKER.parent}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), str(job_file), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**torch.load(out), "log": proc.stderr}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("moe", [None, {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0, "balance": "bias",
                                        "bias_update_rate": 0.01}], ids=["dense", "moe-bias"])
def test_dp2_matches_one_process(byte_tokens, tmp_path, moe):
    from trainer_ddp_worker import main as train_in_process

    train_in_process(str(job(tmp_path, byte_tokens, "one", 1, moe)), str(tmp_path / "one.pt"))
    one = torch.load(tmp_path / "one.pt")
    two = launch(job(tmp_path, byte_tokens, "two", 2, moe), tmp_path / "two.pt", 2)
    assert one["losses"][-1] < one["losses"][0]
    assert "rank 1: dp_replicate=1" in two["log"]  # the rank placement printed at start
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(two["grad_norms"]), torch.tensor(one["grad_norms"]), rtol=1e-4, atol=1e-6)
    assert one["state"].keys() == two["state"].keys()
    for name, w in one["state"].items():
        torch.testing.assert_close(two["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    if moe:  # the routing bias moved, identically on both layouts
        assert one["state"]["layers.0.mlp.expert_bias"].abs().sum() > 0
