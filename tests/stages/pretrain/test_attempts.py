"""Task-level attempts of a training job (stages/attempts.py): what the next launch is told, and what a
divergence does to the output's checkpoints, without launching anything."""

from __future__ import annotations

import json

import pytest

from infra.config.train import SpikeConfig
from infra.launch.job import JobResult, JobSpec
from stages.attempts import next_launch, read_attempts, settle
from trainer.checkpoint import committed_steps
from infra.store import FileStore


def _spec(out) -> JobSpec:
    return JobSpec(job_id="j", stage="pretrain", config={}, output=str(out), workdir=str(out / "w"))


def _checkpoints(out, steps):
    for s in steps:
        d = out / "checkpoints" / f"step_{s:08d}"
        d.mkdir(parents=True)
        (d / "model.bin").write_bytes(b"x")
        (d / "manifest.json").write_text(json.dumps({"step": s}))


def test_divergences_roll_back_lower_the_lr_and_spend_the_budget(tmp_path):
    spike = SpikeConfig(task_rollbacks=2, task_lr_factor=0.5)
    _checkpoints(tmp_path, [5, 10, 15])
    first = next_launch(_spec(tmp_path), spike)
    assert (first.attempt, first.lr_scale, first.skip_windows) == (0, 1.0, [])

    rec = settle(first, JobResult(status="diverged", steps=17, skip_windows=[[128, 136]]), 2, spike, log=lambda m: None)
    assert rec["dropped_step"] == 15 and rec["resume_step"] == 10 and rec["next_lr_scale"] == 0.5
    assert committed_steps(FileStore(str(tmp_path))) == [10, 5]

    (tmp_path / "result.json").write_text("{}")  # the diverged attempt's; the next launch must not read it
    second = next_launch(_spec(tmp_path), spike)
    assert not (tmp_path / "result.json").exists()
    assert (second.attempt, second.lr_scale, second.skip_windows) == (1, 0.5, [[128, 136]])
    assert second.previous_attempt_ended_at == read_attempts(_spec(tmp_path))[0]["ended_at"]  # restart time counts from it

    settle(second, None, -9, spike, log=lambda m: None)  # killed: no result.json, just relaunched
    assert committed_steps(FileStore(str(tmp_path))) == [10, 5]
    third = next_launch(_spec(tmp_path), spike)
    assert (third.attempt, third.lr_scale) == (2, 0.5)

    rec = settle(third, JobResult(status="diverged", steps=12), 2, spike, log=lambda m: None)
    assert rec["resume_step"] == 5 and committed_steps(FileStore(str(tmp_path))) == [5]
    fourth = next_launch(_spec(tmp_path), spike)
    assert fourth.lr_scale == pytest.approx(0.25)
    rec = settle(fourth, JobResult(status="diverged", steps=9), 2, spike, log=lambda m: None)
    assert "giving up" in rec["event"] and "resume_step" not in rec
    assert committed_steps(FileStore(str(tmp_path))) == [5]  # nothing dropped once the budget is spent
    assert [a["status"] for a in read_attempts(_spec(tmp_path))] == ["diverged", "failed", "diverged", "diverged"]


def test_rollback_without_an_earlier_checkpoint_restarts_from_scratch(tmp_path):
    spike = SpikeConfig()
    _checkpoints(tmp_path, [10])
    rec = settle(next_launch(_spec(tmp_path), spike), JobResult(status="diverged", steps=12), 2, spike,
                 log=lambda m: None)
    assert rec["resume_step"] == 0 and committed_steps(FileStore(str(tmp_path))) == []


def _two_node_spec(out, elastic: bool) -> JobSpec:
    from fixtures.trainer_data import tiny_config

    cfg = tiny_config().model_dump(mode="json")
    cfg["parallel"].update(nnodes=2, nproc_per_node=1, dp=2)
    cfg["infra"]["elastic"] = elastic
    return JobSpec(job_id="j", stage="pretrain", config=cfg, output=str(out), workdir=str(out / "w"))


@pytest.mark.parametrize("elastic", [True, False])
def test_a_lost_node_shrinks_the_next_launch_only_when_elastic(tmp_path, elastic):
    spike, said = SpikeConfig(), []
    first = next_launch(_two_node_spec(tmp_path, elastic), spike)
    settle(first, None, 1, spike, log=said.append, bad_nodes=["vm-2"])
    second = next_launch(_two_node_spec(tmp_path, elastic), spike, log=said.append)
    assert read_attempts(second)[0]["bad_nodes"] == ["vm-2"]
    want = (1, 1) if elastic else (2, 2)
    assert (second.config["parallel"]["nnodes"], second.config["parallel"]["dp"]) == want
    assert second.config["pretrain"]["global_batch_size"] == first.config["pretrain"]["global_batch_size"]
    if elastic:
        assert "runs on 1 node(s), dp 2 -> 1" in said[-1]
    # a second lost node leaves none: the launch keeps its size and says why
    settle(second, None, 1, spike, log=said.append, bad_nodes=["vm-1"])
    third = next_launch(_two_node_spec(tmp_path, elastic), spike, log=said.append)
    assert third.config["parallel"]["nnodes"] == 2
    if elastic:
        assert "no node left" in said[-1]
