"""Two gloo ranks under torchrun: a rank killed with SIGKILL, or hung until the collective timeout, ends
the group; torchrun's restart (pretrain.max_restarts through the local launcher) resumes from the
latest committed checkpoint with no manual step, and the final weights are bit-identical to an
uninterrupted run (so DDP's exact resume holds too). Resharding: the dp=2 checkpoint loads onto one
process and a one-process checkpoint onto dp=2, with weights equal at load and the data position
carried over by global sample index. Stragglers (trainer/stragglers.py) ride on the same launches: the
killed run's rank 1 is also made slow before the kill (0.1 s of sleep in each of its two forwards per
step) and is reported as the slowest on most steps, with at least those 0.2 s in its window; the
uninterrupted run's slowest window stays well under them. Wall time on a loaded 2-core machine is noise
for the ratio of two ~15 ms windows (CI saw a median of 1.50 for the even run and 1.64 for one slowed
step), so the ratio is checked only for its bounds."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from faults_jobs import assert_equal_weights, checkpoint_weights, job, launch, losses, result, run_in_process
from infra.config import LifecycleConfig
from trainer.checkpoint import step_dir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = dict(steps=6, checkpoint={"every": 2}, micro_batch_size=2, global_batch_size=8)
TIMED = dict(STEPS, straggler_detection=True)  # the same jobs with straggler detection (weights unchanged)


@pytest.fixture(scope="module")
def reference(byte_tokens, tmp_path_factory):
    """An uninterrupted dp=2 run: final weights, losses, and its output folder (checkpoints 4 and 6)."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = job(tmp, byte_tokens, "ref", dp=2, **TIMED)
    code, log = launch(spec, tmp, 2)
    assert code == 0, log[-4000:]
    res = result(spec)
    even = straggler_rows(spec)
    assert len(even) == 6 and all(well_formed(r) for r in even), even
    # no rank carries a straggler's 0.2 s: the median over steps of the slowest window was 12-68 ms in seven
    # CI runs on 2 loaded cores (one step reached 0.14 s)
    assert statistics.median(r["straggler/compute_s_max"] for r in even) < SLOWED_S, even
    return {"spec": spec, "weights": checkpoint_weights(res.checkpoint, spec.config), "losses": losses(spec)}


SLOWED_S = 2 * 0.1  # the slow rank's sleep per step: two micro-batches' forwards (8 / (2 x dp 2)), 0.1 s each


def well_formed(row: dict) -> bool:
    """max / median of two ranks lies in [1, 2]; the slowest window is the max."""
    return (1.0 <= row["straggler/ratio"] <= 2.0 + 1e-9
            and row["straggler/compute_s_max"] >= row["straggler/compute_s_median"] > 0)


def straggler_rows(spec) -> list[dict]:
    rows = [json.loads(line) for line in (Path(spec.output) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("straggler/") or k in ("step", "restart_s")}
            for r in rows if "straggler/ratio" in r or "restart_s" in r]


def run_with_launcher(spec, tmp: Path, timeout: float = 200) -> tuple[int, str]:
    from infra.launch import get_launcher

    launcher = get_launcher(LifecycleConfig.model_validate(spec.config))
    handle = launcher.submit(spec, spec.write(tmp / f"{spec.job_id}.yaml"))
    code = handle.wait(timeout)
    return code, handle.log_path.read_text(errors="replace")


def test_killed_rank_restarts_from_checkpoint(reference, byte_tokens, tmp_path):
    # Rank 1 is also a straggler on the first attempt (a sleep per forward: the weights are unchanged).
    spec = job(tmp_path, byte_tokens, "killed", dp=2, max_restarts=1,
               faults={"kill_rank": 1, "kill_step": 5, "slow_rank": 1, "slow_s": 0.1}, **TIMED)
    code, log = run_with_launcher(spec, tmp_path)
    assert code == 0, log[-4000:]
    # Step 2's checkpoint is committed before step 4's save starts; step 4's may still be in flight.
    assert "SIGKILLs itself after step 5" in log and re.search(r"resumed from step [24] ", log)
    res = result(spec)
    assert res.status == "completed" and res.steps == 6
    assert 0 < res.metrics["restart_s"] < 120
    rows = straggler_rows(spec)
    # the slowed attempt's steps: rows until the restart's row or the first step that goes back (the resumed
    # attempt may log a step before its restart_s row lands)
    first = [rows[0]]
    for r in rows[1:]:
        if "restart_s" in r or r["step"] <= first[-1]["step"]:
            break
        first.append(r)
    assert [r["step"] for r in first][:4] == [1, 2, 3, 4]  # (rank 0 may log step 5 before it sees rank 1 die)
    # rank 1 is the slowest on most steps (on a loaded 2-core machine another process can stall rank 0 for one)
    assert sum(r["straggler/slowest_rank"] == 1.0 for r in first) > len(first) / 2, first
    # by construction: rank 1 slept 0.2 s inside its window on every step, so the slowest window holds it
    assert all(well_formed(r) and r["straggler/compute_s_max"] >= SLOWED_S for r in first), first
    assert_equal_weights(checkpoint_weights(res.checkpoint, spec.config), reference["weights"])


def test_hung_rank_times_out_and_restarts(reference, byte_tokens, tmp_path):
    spec = job(tmp_path, byte_tokens, "hung", dp=2, max_restarts=1, parallel={"collective_timeout_s": 6},
               faults={"hang_rank": 1, "hang_step": 5, "hang_mode": "sleep"}, **STEPS)
    code, log = run_with_launcher(spec, tmp_path)
    assert code == 0, log[-4000:]
    assert "hangs after step 5" in log and re.search(r"resumed from step [24] ", log)
    res = result(spec)
    assert res.status == "completed"
    assert_equal_weights(checkpoint_weights(res.checkpoint, spec.config), reference["weights"])


def test_dp2_checkpoint_loads_on_one_process(reference, byte_tokens, tmp_path):
    from trainer.parallel.ddp import unwrap
    from trainer.trainer import Trainer

    ref = reference["spec"]
    spec = job(tmp_path, byte_tokens, "one", **STEPS)
    src = Path(ref.output) / "checkpoints" / step_dir(4)
    shutil.copytree(src, Path(spec.output) / "checkpoints" / step_dir(4))
    tr = Trainer(spec)
    assert tr.step == 4 and tr.loader.next_sample == 4 * 8  # the global sample position carried over
    saved = checkpoint_weights(src, ref.config)
    assert_equal_weights({k: v for k, v in unwrap(tr.model).state_dict().items()}, saved)
    res = tr.run()
    assert res.status == "completed"
    # Steps 5 and 6 see the same samples as on dp=2: same losses (fp32; reduction order differs).
    for s in (5, 6):
        assert losses(spec)[s] == pytest.approx(reference["losses"][s], rel=1e-5)
    for k, v in checkpoint_weights(res.checkpoint, spec.config).items():
        torch.testing.assert_close(v, reference["weights"][k], rtol=1e-5, atol=1e-6)


def test_one_process_checkpoint_loads_on_dp2(byte_tokens, tmp_path):
    whole = job(tmp_path, byte_tokens, "whole1", **{**STEPS, "checkpoint": {"every": 3}})
    full = run_in_process(whole)
    spec = job(tmp_path, byte_tokens, "dp2", dp=2, **STEPS)
    shutil.copytree(Path(whole.output) / "checkpoints" / step_dir(3), Path(spec.output) / "checkpoints" / step_dir(3))
    code, log = launch(spec, tmp_path, 2)
    assert code == 0, log[-4000:]
    assert "resumed from step 3" in log and "saved on 1 rank(s)" in log and "loading on 2" in log
    assert sorted(losses(spec)) == [4, 5, 6]
    for s in (4, 5, 6):
        assert losses(spec)[s] == pytest.approx(losses(whole)[s], rel=1e-5)
    for k, v in checkpoint_weights(result(spec).checkpoint, spec.config).items():
        torch.testing.assert_close(v, checkpoint_weights(full.checkpoint, whole.config)[k], rtol=1e-5, atol=1e-6)
