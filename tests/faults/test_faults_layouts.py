"""Exact resume and resharding on the parallel layouts (trainer/parallel): ZeRO-1 over dp=2, dp=2
(FSDP2) x tp=2, and the seed's dp=2 x tp=2 x pp=2 mesh with ZeRO-1 (a TP x PP layout) stopped and
resumed give final weights torch.equal to never stopping (fp32, CPU, gloo); the dp=2 x tp=2
checkpoint also loads onto pp=2 x dp=2, the seed mesh's onto dp=4 ZeRO-1, tp=2 x pp=2 and one process,
and a one-process checkpoint onto ZeRO-1 dp=2, and training continues to the same losses and weights
(within float tolerance: a different layout sums in a different order)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from faults_jobs import ROOT, assert_equal_weights, checkpoint_weights, job, losses, run_in_process
from trainer.checkpoint import step_dir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("faults_resume_worker.py")
STEPS = dict(steps=4, checkpoint={"every": 2}, micro_batch_size=2, global_batch_size=8, warmup_steps=1)


def final(spec) -> dict[str, torch.Tensor]:
    return checkpoint_weights(Path(spec.output) / "checkpoints" / step_dir(4), spec.config)


def run_worker(tmp: Path, nproc: int, specs) -> str:
    """specs[0] "-": no job A (the test copied the checkpoint in already)."""
    files = [s if s == "-" else str(s.write(tmp / f"{s.job_id}.yaml")) for s in specs]
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


def copy_checkpoint(src, step: int, *dst) -> None:
    for spec in dst:
        shutil.copytree(Path(src.output) / "checkpoints" / step_dir(step),
                        Path(spec.output) / "checkpoints" / step_dir(step))


# bf16 weights are the masters rounded: another summation order may round one the other way, so the
# bound is one bf16 step (2^-7 relative); measured 4.9e-4 at most, loss 1.1e-5 relative (one run).
TOLERANCE = {"fp32": {}, "bf16": dict(loss_rel=2e-4, rtol=2**-7, atol=1e-4)}


def assert_resumed_like(resumed, whole, reference: dict[str, torch.Tensor], loss_rel: float = 1e-5,
                        rtol: float = 1e-5, atol: float = 1e-6) -> dict[str, float]:
    """Steps 3 and 4 after a resume at step 2 against the uninterrupted run: losses within rel 1e-5,
    final weights within rtol 1e-5 / atol 1e-6 (another layout sums in another order: fp32 rounding,
    ~1e-7 relative per sum). Step 3's loss checks the weights; step 4's the optimizer state too (a lost
    or misplaced moment moves it by ~1e-2). Returns the losses (resumed, uninterrupted) and the largest
    differences."""
    got, want = losses(resumed), losses(whole)
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        assert got[s] == pytest.approx(want[s], rel=loss_rel), (resumed.job_id, s)
    weights = final(resumed)
    assert weights.keys() == reference.keys()
    for k, v in weights.items():
        torch.testing.assert_close(v.float(), reference[k].float(), rtol=rtol, atol=atol, msg=f"{resumed.job_id} {k}")
    return {"losses": {s: (got[s], want[s]) for s in (3, 4)}, "loss": max(abs(got[s] - want[s]) for s in (3, 4)),
            "weight": max(float((weights[k] - reference[k]).abs().max()) for k in weights)}


def test_seed_mesh_zero1_resume_and_reshard(byte_tokens, tmp_path):
    """The seed's mesh, dp=2 x tp=2 x pp=2 with ZeRO-1, sequence parallel and 1F1B (4 micro-batches of 2 per
    replica), stopped at step 2: resumed on the same mesh it gives the same weights bit for bit; its
    checkpoint (ZeRO-1's moments sharded over dp, inside tp shards, on two pipeline stages) also resumes
    on dp=4 (ZeRO-1 over 4), on tp=2 x pp=2 (dp=1, a plain optimizer) and on one process (plain AdamW),
    each continuing as the seed mesh does. Four launches: 8 ranks, 4 ranks, one process."""
    seed = {"tp": 2, "pp": 2, "zero": 1, "sequence_parallel": True, "pp_schedule": "1f1b", "nproc_per_node": 8}
    steps = {**STEPS, "global_batch_size": 16}
    whole = job(tmp_path, byte_tokens, "seed-whole", dp=2, parallel=seed, **steps)
    resumed = job(tmp_path, byte_tokens, "seed-resumed", dp=2, parallel=seed, **steps)
    log = run_worker(tmp_path, 8, [whole, resumed])
    assert "resumed from step 2" in log
    assert sorted(losses(resumed)) == [3, 4]
    for s in (3, 4):
        assert losses(resumed)[s] == losses(whole)[s]
    reference = final(whole)
    assert_equal_weights(final(resumed), reference)
    saved = Path(whole.output) / "checkpoints" / step_dir(2)
    assert not (saved / "optim").exists()  # ZeRO-1's state is in DCP's files, by parameter name

    dp4 = job(tmp_path, byte_tokens, "seed-to-dp4", dp=4, parallel={"zero": 1, "nproc_per_node": 4}, **steps)
    tp_pp = job(tmp_path, byte_tokens, "seed-to-tp2pp2", dp=1,
                parallel={"tp": 2, "pp": 2, "sequence_parallel": True, "pp_schedule": "1f1b", "nproc_per_node": 4},
                **steps)
    one = job(tmp_path, byte_tokens, "seed-to-one", **steps)
    copy_checkpoint(whole, 2, dp4, tp_pp, one)
    log = run_worker(tmp_path, 4, ["-", dp4, tp_pp])
    assert log.count("resumed from step 2") == 2
    assert run_in_process(one).status == "completed"
    diffs = {spec.job_id: assert_resumed_like(spec, whole, reference) for spec in (dp4, tp_pp, one)}
    print("max |difference| against the uninterrupted seed mesh:", diffs)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_process_checkpoint_resumes_on_zero1_dp2(byte_tokens, tmp_path, precision):
    """A plain AdamW checkpoint of one process resumes under ZeRO-1 over dp=2 (moments cut into its
    segments by DCP) and continues as the one process does. bf16: the one process's fp32 masters
    (MasterAdamW's "master", trainer.precision) become ZeRO-1's, under the same key."""
    whole = job(tmp_path, byte_tokens, "one-whole", precision=precision, **STEPS)
    assert run_in_process(whole).status == "completed"
    z1 = job(tmp_path, byte_tokens, "one-to-zero1", dp=2, parallel={"zero": 1}, precision=precision, **STEPS)
    copy_checkpoint(whole, 2, z1)
    assert "resumed from step 2" in run_worker(tmp_path, 2, ["-", z1])
    saved = dcp.FileSystemReader(str(Path(whole.output) / "checkpoints" / step_dir(2))).read_metadata()
    assert any(k.endswith(".master") for k in saved.state_dict_metadata) == (precision == "bf16")
    diffs = assert_resumed_like(z1, whole, final(whole), **TOLERANCE[precision])
    print("max |difference| against one process:", diffs)
