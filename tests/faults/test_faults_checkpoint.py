"""Checkpoints in one process: exact resume (fp32, torch.equal to never stopping), commit by manifest,
fallback past a truncated/flipped shard or a missing manifest, retention, and a storage outage during
upload (real S3 endpoint behind a failing proxy) retried with no checkpoint lost."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from faults_jobs import assert_equal_weights, checkpoint_weights, job, losses, run_in_process
from infra.config.train import CheckpointConfig
from infra.store import FileStore
from trainer.checkpoint import Checkpointer, committed_steps, read_manifest, step_dir
from trainer.faults import damage_checkpoint


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stop_and_resume_is_bit_identical(byte_tokens, tmp_path, precision):
    """bf16: bf16 weights in the model, fp32 masters and moments in the checkpoint's optimizer state."""
    whole = job(tmp_path, byte_tokens, "whole", steps=6, checkpoint={"every": 3}, precision=precision)
    res = run_in_process(whole)
    assert res.status == "completed" and res.checkpoint.endswith("checkpoints/step_00000006")
    out = Path(whole.output)
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [step_dir(3), step_dir(6)]
    manifest = read_manifest(FileStore(out), 6).manifest
    assert manifest["step"] == 6 and manifest["trainer_state"]["loader"]["next_sample"] == 6 * 8
    assert {".metadata", "rng/rank0.pt"} <= set(manifest["files"])

    # The same job stopped after step 3: only the step-3 checkpoint exists; resuming trains 4..6.
    stopped = job(tmp_path, byte_tokens, "stopped", steps=6, checkpoint={"every": 3}, precision=precision)
    shutil.copytree(out / "checkpoints" / step_dir(3), Path(stopped.output) / "checkpoints" / step_dir(3))
    res2 = run_in_process(stopped)
    assert res2.status == "completed" and res2.steps == 6
    assert sorted(losses(stopped)) == [4, 5, 6]  # it really started at step 3
    for s in (4, 5, 6):
        assert losses(stopped)[s] == losses(whole)[s]
    assert_equal_weights(checkpoint_weights(res2.checkpoint, stopped.config),
                         checkpoint_weights(res.checkpoint, whole.config))

    if precision == "bf16":  # what the model holds is bf16; the fp32 masters ride in the optimizer state
        saved = metadata(out, 6)
        weights = {k: m.properties.dtype for k, m in saved.items() if k.startswith("model.")}
        masters = {k: m.properties.dtype for k, m in saved.items() if k.startswith("optim.state.") and k.endswith(".master")}
        assert set(weights.values()) == {torch.bfloat16} and set(masters.values()) == {torch.float32}
        assert {k.removeprefix("model.") for k in weights} == {k[len("optim.state."):-len(".master")] for k in masters}
        return
    # The export stage finds the committed checkpoint through result.json (its contract).
    from stages.export.merge import find_checkpoint, load_full_state_dict

    found = find_checkpoint(out)
    assert found == out / "checkpoints" / step_dir(6)
    full, mine = load_full_state_dict(found), checkpoint_weights(res.checkpoint, whole.config)
    common = set(full) & set(mine)
    assert len(common) >= len(mine) // 2
    for k in common:
        assert torch.equal(full[k], mine[k]), k


def metadata(out: Path, step: int) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(out / "checkpoints" / step_dir(step))).read_metadata().state_dict_metadata


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)


def tiny_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model.b(model.a(torch.randn(4, 8, generator=g))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def saved_run(store, tmp_path, steps, cfg=None, async_save=True):
    """Save after each of `steps` optimizer steps; returns {step: weights} and the checkpointer."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(store, cfg or CheckpointConfig(every=1, keep_last=10), tmp_path / "staging", {"world_size": 1})
    weights = {}
    for s in range(1, steps + 1):
        tiny_step(model, opt, s)
        ck.save(s, model, opt, {"step": s}, async_save=async_save)
        weights[s] = {k: v.clone() for k, v in model.state_dict().items()}
    ck.wait()
    return weights, ck


def load_into_fresh(store, tmp_path):
    torch.manual_seed(1)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(store, CheckpointConfig(), tmp_path / "staging-load", {"world_size": 1})
    manifest = ck.load_latest(model, opt)
    return manifest, model


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_manifest"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, damage):
    store = FileStore(tmp_path / "out")
    weights, _ = saved_run(store, tmp_path, 3)
    damage_checkpoint(store, 3, damage)
    manifest, model = load_into_fresh(store, tmp_path)
    assert manifest["step"] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[2][k])
    if damage == "drop_manifest":
        assert committed_steps(store) == [2, 1]  # a folder without its manifest does not exist
        # Damage the previous one too: it falls back once more.
        damage_checkpoint(store, 2, "truncate")
        manifest, _ = load_into_fresh(store, tmp_path)
        assert manifest["step"] == 1


def test_optimizer_state_round_trips(tmp_path):
    store = FileStore(tmp_path / "out")
    torch.manual_seed(0)
    model, opt = Tiny(), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tiny_step(model, opt, 1)
    ck = Checkpointer(store, CheckpointConfig(), tmp_path / "st", {"world_size": 1})
    ck.save(1, model, opt, {"step": 1}, async_save=False)
    # Two more steps from the original and from a restored copy give identical weights.
    torch.manual_seed(5)
    model2 = Tiny()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    Checkpointer(store, CheckpointConfig(), tmp_path / "st2", {"world_size": 1}).load_latest(model2, opt2)
    for s in (2, 3):
        tiny_step(model, opt, s)
        tiny_step(model2, opt2, s)
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k])


def test_retention_keeps_last_k_plus_every_mth(tmp_path):
    store = FileStore(tmp_path / "out")
    saved_run(store, tmp_path, 7, CheckpointConfig(every=1, keep_last=2, keep_every=3))
    assert committed_steps(store) == [7, 6, 3]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [step_dir(3), step_dir(6), step_dir(7)]


def test_storage_outage_during_upload_is_retried(flaky_proxy, tmp_path):
    """503s and dropped connections on uploads (the S3 fixtures' proxy, real sockets): every
    checkpoint still commits and loads with verified sha256."""
    from fixtures.s3 import FAST_RETRY, new_bucket_name
    from infra.s3 import S3Store

    store = S3Store(new_bucket_name(), endpoint_url=flaky_proxy.url, **{**FAST_RETRY, "attempts": 4})
    store.ensure_bucket()
    puts = {"n": 0}

    def plan(method, path, n):
        if method != "PUT":
            return None
        puts["n"] += 1
        return {1: 503, 2: "drop", 4: 500, 7: 503, 8: 503}.get(puts["n"])

    flaky_proxy.plan = plan
    weights, ck = saved_run(store, tmp_path, 2)
    outcomes = flaky_proxy.outcomes()
    assert 503 in outcomes and 500 in outcomes and "drop" in outcomes
    assert committed_steps(store) == [2, 1]
    flaky_proxy.plan = lambda *a: None
    manifest, model = load_into_fresh(store, tmp_path)
    assert manifest["step"] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[2][k])
    for s in (1, 2):
        m = read_manifest(store, s).manifest
        assert set(store.list(f"checkpoints/{step_dir(s)}")) >= {f"checkpoints/{step_dir(s)}/{f}" for f in m["files"]}
