"""Every parallel layout survives a kill: one rank SIGKILLs itself after a step drawn at random,
torchrun restarts the group, the job resumes from its latest committed checkpoint (asynchronous, so
the newest one may have been in flight when the rank died) and ends with weights torch.equal to the
same job never interrupted (fp32, CPU, gloo). The draw is printed; EIGHTFOLD_KILL_SEED replays it.

One torchrun launch per world size runs every layout of that size (faults_kill_worker.py), so the
matrix pays the process start-up once per kill rather than per job."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from infra.config import LifecycleConfig
from faults_jobs import ROOT, assert_equal_weights, checkpoint_weights, job, losses
from trainer.checkpoint import step_dir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("faults_kill_worker.py")
STEPS = 5
TRAIN = dict(steps=STEPS, checkpoint={"every": 1}, micro_batch_size=2, global_batch_size=8, warmup_steps=1)

DATA2 = {  # name -> parallel settings (2 ranks), data parallel
    "ddp2": dict(dp=2),
    "zero1-dp2": dict(dp=2, zero=1),
    "zero1-dp2-bf16": dict(dp=2, zero=1, precision="bf16"),  # bf16 weights; sharded fp32 masters in the checkpoint
    "zero3-dp2": dict(dp=2, zero=3),
}
MODEL2 = {  # model parallel
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2-gpipe": dict(pp=2, pp_schedule="gpipe"),
    "pp2-1f1b": dict(pp=2, pp_schedule="1f1b"),
    "cp2-ring": dict(cp=2, cp_impl="ring"),
    "cp2-ulysses": dict(cp=2, cp_impl="ulysses"),
}
WORLD4 = {
    "hsdp-2x2": dict(dp=4, dp_replicate=2, zero=2),
    "dp2-tp2-zero1": dict(dp=2, tp=2, zero=1),
    "dp2-pp2-zero1-1f1b": dict(dp=2, pp=2, zero=1, pp_schedule="1f1b"),
}


def kill_plan(names: list[str], world: int) -> dict[str, tuple[int, int]]:
    """(rank, step) for each layout: a rank and a step after the first checkpoint and before the last."""
    seed = int(os.environ.get("EIGHTFOLD_KILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    plan = {n: (rng.randrange(world), rng.randint(2, STEPS - 1)) for n in names}
    print(f"kill plan (EIGHTFOLD_KILL_SEED={seed}): {plan}")
    return plan


def run_matrix(tmp: Path, tokens: Path, world: int, layouts: dict[str, dict]) -> None:
    plan = kill_plan(list(layouts), world)
    specs, pairs = [], {}
    for attempt, (name, par) in enumerate(layouts.items()):
        par = {**par, "nproc_per_node": world}
        dp = par.pop("dp", 1)
        train = {**TRAIN, "precision": par.pop("precision", "fp32")}
        rank, step = plan[name]
        whole = job(tmp, tokens, f"{name}-whole", dp=dp, parallel=par, **train)
        killed = job(tmp, tokens, f"{name}-killed", dp=dp, parallel=par,
                     faults={"kill_rank": rank, "kill_step": step, "attempt": attempt}, **train)
        for spec in (whole, killed):  # a bad layout fails here, not on every restart of the launch
            spec.config["infra"]["health_check"] = False  # the pre-flight has its own tests
            LifecycleConfig.model_validate(spec.config)
        specs += [whole, killed]
        pairs[name] = (whole, killed, step)
    files = [str(s.write(tmp / f"{s.job_id}.yaml")) for s in specs]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKER.parent}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                           f"--max-restarts={len(layouts)}", "--monitor-interval=0.2", str(WORKER), *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    failures = []
    for name, (whole, killed, step) in pairs.items():
        try:
            final = step_dir(STEPS)
            assert_equal_weights(checkpoint_weights(Path(killed.output) / "checkpoints" / final, killed.config),
                                 checkpoint_weights(Path(whole.output) / "checkpoints" / final, whole.config))
            ref = losses(whole)
            assert all(loss == ref[s] for s, loss in losses(killed).items()), (losses(killed), ref)
        except AssertionError as exc:
            failures.append(f"{name} (killed after step {step}): {str(exc)[:500]}")
    assert not failures, "\n".join(failures)
    assert log.count("SIGKILLs itself") == len(layouts) and log.count("resumed from step") >= len(layouts), log[-6000:]


@pytest.mark.timeout(1200)
def test_every_two_rank_data_parallel_layout_survives_a_kill(byte_tokens, tmp_path):
    run_matrix(tmp_path, byte_tokens, 2, DATA2)


@pytest.mark.timeout(1200)
def test_every_two_rank_model_parallel_layout_survives_a_kill(byte_tokens, tmp_path):
    run_matrix(tmp_path, byte_tokens, 2, MODEL2)


@pytest.mark.timeout(1200)
def test_every_four_rank_layout_survives_a_kill(byte_tokens, tmp_path):
    run_matrix(tmp_path, byte_tokens, 4, WORLD4)
