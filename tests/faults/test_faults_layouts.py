"""Exact resume and resharding on the parallel layouts (trainer/parallel): ZeRO-1 over dp=2, dp=2
(FSDP2) x tp=2, and the seed's dp=2 x tp=2 x pp=2 mesh with ZeRO-1 (a TP x PP layout) stopped and
resumed give final weights torch.equal to never stopping (fp32, CPU, gloo); the dp=2 x tp=2
checkpoint also loads onto pp=2 x dp=2 and training continues to the same weights (within float
tolerance: a different layout sums in a different order)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from faults_jobs import ROOT, assert_equal_weights, checkpoint_weights, job, losses
from trainer.checkpoint import step_dir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("faults_resume_worker.py")
STEPS = dict(steps=4, checkpoint={"every": 2}, micro_batch_size=2, global_batch_size=8, warmup_steps=1)


def final(spec) -> dict[str, torch.Tensor]:
    return checkpoint_weights(Path(spec.output) / "checkpoints" / step_dir(4), spec.config)


def run_worker(tmp: Path, nproc: int, specs) -> str:
    files = [str(s.write(tmp / f"{s.job_id}.yaml")) for s in specs]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKER.parent}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(WORKER), "2", *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stderr


def test_zero1_exact_resume(byte_tokens, tmp_path):
    par = {"zero": 1}
    whole = job(tmp_path, byte_tokens, "z1-whole", dp=2, parallel=par, **STEPS)
    resumed = job(tmp_path, byte_tokens, "z1-resumed", dp=2, parallel=par, **STEPS)
    log = run_worker(tmp_path, 2, [whole, resumed])
    assert "resumed from step 2" in log
    assert sorted(losses(resumed)) == [3, 4]
    assert_equal_weights(final(resumed), final(whole))


def test_dp_tp_exact_resume_and_reshard_to_pp_dp(byte_tokens, tmp_path):
    """dp=2 (FSDP2, zero=2) x tp=2, resumed as it was and resharded onto pp=2 x dp=2."""
    dp_tp = {"tp": 2, "zero": 2, "nproc_per_node": 4}
    whole = job(tmp_path, byte_tokens, "dptp-whole", dp=2, parallel=dp_tp, **STEPS)
    resumed = job(tmp_path, byte_tokens, "dptp-resumed", dp=2, parallel=dp_tp, **STEPS)
    moved = job(tmp_path, byte_tokens, "ppdp", dp=2, parallel={"pp": 2, "nproc_per_node": 4}, **STEPS)
    log = run_worker(tmp_path, 4, [whole, resumed, moved])
    assert log.count("resumed from step 2") == 2
    reference = final(whole)
    assert_equal_weights(final(resumed), reference)
    assert sorted(losses(moved)) == [3, 4]
    for s in (3, 4):
        assert losses(moved)[s] == pytest.approx(losses(whole)[s], rel=1e-5)
    for k, v in final(moved).items():
        torch.testing.assert_close(v, reference[k], rtol=1e-5, atol=1e-6, msg=k)


def test_seed_mesh_tp_pp_zero1_exact_resume(byte_tokens, tmp_path):
    """The seed's mesh, dp=2 x tp=2 x pp=2 with ZeRO-1, sequence parallel and 1F1B (4 micro-batches of 2 per
    replica): a TP x PP layout whose optimizer state is sharded over dp, stopped at step 2 and resumed."""
    seed = {"tp": 2, "pp": 2, "zero": 1, "sequence_parallel": True, "pp_schedule": "1f1b", "nproc_per_node": 8}
    steps = {**STEPS, "global_batch_size": 16}
    whole = job(tmp_path, byte_tokens, "seed-whole", dp=2, parallel=seed, **steps)
    resumed = job(tmp_path, byte_tokens, "seed-resumed", dp=2, parallel=seed, **steps)
    log = run_worker(tmp_path, 8, [whole, resumed])
    assert "resumed from step 2" in log
    assert sorted(losses(resumed)) == [3, 4]
    for s in (3, 4):
        assert losses(resumed)[s] == losses(whole)[s]
    assert_equal_weights(final(resumed), final(whole))
