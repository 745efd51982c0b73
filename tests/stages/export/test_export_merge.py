"""Merging checkpoints: DCP folders and plain files give the full model state dict without optimizer
state; TP / PP / EP shards split by hand (Megatron's rules written out here) merge back exactly, and the
merged model exports to the same Hugging Face weights as the single-process one."""

from __future__ import annotations

import json
import re

import pytest
import torch
from export_models import random_model_state, tiny_cfg

from infra.config.model import MoEConfig
from stages.export.hf import read_safetensors, write_hf
from stages.export.merge import (MergeError, RankShard, find_checkpoint, load_full_state_dict, merge_ep, merge_pp,
                                 merge_shards, merge_tp)


def split_tp(sd, tp, kv_heads):
    """Megatron by hand: q/k/v, gate, up and the vocabulary split along output rows (dim 0); o and down
    along input columns (dim 1); fewer KV heads than ranks -> each rank holds a copy of its group's head."""
    shards = [{} for _ in range(tp)]
    for name, t in sd.items():
        if re.search(r"(q_proj|gate_proj|up_proj)\.weight$", name) or name in ("embed_tokens.weight", "lm_head.weight"):
            parts = list(t.chunk(tp, 0))
        elif re.search(r"(k_proj|v_proj)\.weight$", name):
            if kv_heads >= tp:
                parts = list(t.chunk(tp, 0))
            else:
                heads = t.chunk(kv_heads, 0)
                parts = [heads[r * kv_heads // tp] for r in range(tp)]
        elif re.search(r"(o_proj|down_proj)\.weight$", name):
            parts = list(t.chunk(tp, 1))
        else:
            parts = [t] * tp
        for r in range(tp):
            shards[r][name] = parts[r].clone()
    return shards


def split_pp(sd, first_stage_layers):
    stages = [{}, {}]
    for name, t in sd.items():
        m = re.match(r"layers\.(\d+)\.", name)
        if name == "embed_tokens.weight" or (m and int(m.group(1)) < first_stage_layers):
            stages[0][name] = t
        else:
            stages[1][name] = t
    return stages


def split_ep(sd, ep, num_experts):
    """Local expert names on each rank (rank r holds experts r*E/ep.. as experts.0..)."""
    per = num_experts // ep
    ranks = [{} for _ in range(ep)]
    for name, t in sd.items():
        m = re.match(r"(.*\.experts\.)(\d+)(\..*)", name)
        if m is None:
            for r in range(ep):
                ranks[r][name] = t.clone()
        else:
            e = int(m.group(2))
            ranks[e // per][f"{m.group(1)}{e % per}{m.group(3)}"] = t
    return ranks


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_dcp_checkpoint_loads_model_only(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = tiny_cfg(mtp_depth=1)  # the MTP modules' weights are model weights too (they go to the export's sidecar)
    sd = random_model_state(cfg)
    assert "mtp.0.eh_proj.weight" in sd
    optim = {"state": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in sd.items()},
             "param_groups": [{"lr": 1e-3}]}
    dcp.save({"model": sd, "optim": optim, "step": torch.tensor(7)}, checkpoint_id=str(tmp_path / "step_000007"))
    loaded = load_full_state_dict(tmp_path / "step_000007")
    assert_same(loaded, sd)  # optimizer moments and the step counter are not in it


def test_plain_checkpoint_and_find(tmp_path):
    cfg = tiny_cfg()
    sd = random_model_state(cfg)
    for step in (10, 20):
        d = tmp_path / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        wrapped = {f"module.{k}": v + step for k, v in sd.items()}  # DDP's prefix
        torch.save({"model": wrapped, "optimizer": {"exp_avg": torch.zeros(3)}}, d / "model.pt")
        (d / "manifest.json").write_text("{}")
    found = find_checkpoint(tmp_path)
    assert found.name == "step_000020"
    loaded = load_full_state_dict(found)
    assert_same(loaded, {k: v + 20 for k, v in sd.items()})
    (tmp_path / "result.json").write_text(json.dumps({"status": "completed", "checkpoint": "checkpoints/step_000010"}))
    assert find_checkpoint(tmp_path).name == "step_000010"  # result.json's checkpoint wins
    remote = {"status": "completed", "checkpoint": "s3://bucket/exp/pretrain/abc/checkpoints/step_000020"}
    (tmp_path / "result.json").write_text(json.dumps(remote))
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000020"  # found in the downloaded copy


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2)])
def test_tp_merge(tp, kv_heads):
    cfg = tiny_cfg(n_kv_heads=kv_heads)
    sd = random_model_state(cfg)
    assert_same(merge_tp(split_tp(sd, tp, kv_heads), cfg), sd)


def test_tp_merge_rejects_diverged_replicas():
    cfg = tiny_cfg()
    sd = random_model_state(cfg)
    shards = split_tp(sd, 2, 2)
    shards[1]["norm.weight"] = shards[1]["norm.weight"] + 1
    with pytest.raises(MergeError, match="norm.weight.*replicated"):
        merge_tp(shards, cfg)


def test_pp_merge_and_missing_layer():
    cfg = tiny_cfg(n_layers=3)
    sd = random_model_state(cfg)
    assert_same(merge_pp(split_pp(sd, 2)), sd)
    stages = split_pp(sd, 2)
    stages[1] = {k: v for k, v in stages[1].items() if not k.startswith("layers.2.")}
    with pytest.raises(MergeError, match="missing.*layers.2"):
        merge_shards([RankShard(s, pp=i) for i, s in enumerate(stages)], cfg)


def test_ep_merge_local_and_global_names():
    cfg = tiny_cfg(moe=MoEConfig(num_experts=4, top_k=2))
    sd = random_model_state(cfg)
    assert_same(merge_ep(split_ep(sd, 2, 4), 4), sd)
    global_named = [{k: v for k, v in sd.items() if not re.search(r"experts\.[23]\.", k)},
                    {k: v for k, v in sd.items() if not re.search(r"experts\.[01]\.", k)}]
    assert_same(merge_ep(global_named, 4), sd)


def test_tp_pp_ep_mesh_merges_to_same_hf_weights(tmp_path):
    """A 2 x 2 x 2 (tp, pp, ep) MoE layout: merged and exported, byte-identical to the one-process export."""
    cfg = tiny_cfg(moe=MoEConfig(num_experts=4, top_k=2))
    sd = random_model_state(cfg)
    shards = []
    for pp, stage in enumerate(split_pp(sd, 1)):
        for ep, ep_part in enumerate(split_ep(stage, 2, 4)):
            for tp, part in enumerate(split_tp(ep_part, 2, cfg.kv_heads)):
                shards.append(RankShard(part, tp=tp, pp=pp, ep=ep))
    merged = merge_shards(shards, cfg)
    assert_same(merged, sd)
    write_hf(sd, cfg, tmp_path / "one", dtype="float32")
    write_hf(merged, cfg, tmp_path / "mesh", dtype="float32")
    assert_same(read_safetensors(tmp_path / "one"), read_safetensors(tmp_path / "mesh"))


def test_tp_merge_on_wrong_dim_is_caught():
    """Row-parallel pieces joined as if column-parallel make a wrong shape, which the check names."""
    cfg = tiny_cfg()
    sd = random_model_state(cfg)
    shards = split_tp(sd, 2, 2)
    merged = merge_tp(shards, cfg)
    merged["layers.0.mlp.down_proj.weight"] = torch.cat([s["layers.0.mlp.down_proj.weight"] for s in shards], 0)
    from stages.export.merge import complete_state_dict

    with pytest.raises(MergeError, match="layers.0.mlp.down_proj.weight.*shape"):
        complete_state_dict(merged, cfg)
