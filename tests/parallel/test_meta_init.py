"""The model is built on the meta device and each rank materialises only its share, with the values
one process holds there (trainer/model/init.py, trainer/parallel/materialize.py).

- Any region of a parameter, generated alone, equals that region of the whole parameter, across
  generation-block boundaries.
- One process starts from the model's distributions: N(0, init_std) matrices, residual outputs scaled
  by 1/sqrt(2 n_layers), ones for norm gains, zero routing biases; a meta build allocates nothing.
- Under torchrun, at DDP, TP (+SP, bf16), PP, FSDP, EP, TP x PP, TP x FSDP (2-D), PP x FSDP, TP x EP:
  every rank's local values are torch.equal to the slice of the one-process model at their offset,
  and together the ranks hold every value.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.config.model import ModelConfig
from trainer.meta_init import build_model
from trainer.model import Transformer
from trainer.model.init import fill_initial, initial_std, rows_per_block

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import meta_init_worker as W  # noqa: E402

WORLD2 = ["ddp2", "tp2", "tp2_bf16", "pp2", "fsdp_dp2", "ep2"]
WORLD4 = ["tp2_pp2", "tp2_fsdp_dp2", "pp2_fsdp_dp2", "tp2_ep2"]


@pytest.mark.parametrize("shape", [(37, 5), (9, 4, 3), (130, 1)])
def test_any_region_equals_that_slice_of_the_whole(shape):
    block = 13  # elements per block: several rows per block, boundaries everywhere
    assert rows_per_block(shape, block) < shape[0]
    whole = fill_initial(torch.empty(shape), 3, "w", shape, 0.5, block_elements=block)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        start = [int(torch.randint(0, n, (), generator=g)) for n in shape]
        size = [int(torch.randint(1, n - s + 1, (), generator=g)) for s, n in zip(start, shape)]
        part = fill_initial(torch.empty(size), 3, "w", shape, 0.5, start, block_elements=block)
        assert torch.equal(part, whole[tuple(slice(s, s + n) for s, n in zip(start, size))]), (start, size)
    other = fill_initial(torch.empty(shape), 3, "v", shape, 0.5, block_elements=block)
    assert not torch.equal(whole, other)  # another name, other values
    per = rows_per_block(shape, block)
    assert not torch.equal(whole[:per], whole[per : 2 * per])  # each block its own stream
    with pytest.raises(ValueError, match="outside"):
        fill_initial(torch.empty(4, *shape[1:]), 3, "w", shape, 0.5, (shape[0] - 2,) + (0,) * (len(shape) - 1))


def test_one_process_starts_from_the_models_distributions():
    cfg = ModelConfig(vocab_size=4096, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=512, max_seq_len=32,
                      qk_norm=True, moe={"num_experts": 4, "top_k": 2, "every": 2})
    model = Transformer(cfg)
    model.init_weights(seed=11)
    seen = set()
    for name, p in model.named_parameters():
        std = initial_std(cfg, name, p.dim())
        if p.dim() < 2:
            assert std is None and torch.equal(p, torch.ones_like(p)), name
            continue
        want = cfg.init_std / (12 ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
        assert std == pytest.approx(want)
        p = p.detach()
        assert abs(float(p.std()) / want - 1) < 0.05 and abs(float(p.mean())) < 0.1 * want, name
        key = float(p.flatten()[0])
        assert key not in seen, f"{name} repeats another parameter's stream"
        seen.add(key)
    assert all(torch.equal(m.expert_bias, torch.zeros(4)) for m in model.modules() if hasattr(m, "expert_bias"))
    again = Transformer(cfg)
    again.init_weights(seed=11)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    again.init_weights(seed=12)
    assert not torch.equal(model.lm_head.weight, again.lm_head.weight)
    torch.manual_seed(5)  # without a seed, torch's generator decides, as before
    a = Transformer(cfg)
    torch.manual_seed(5)
    assert torch.equal(a.embed_tokens.weight, Transformer(cfg).embed_tokens.weight)


def test_a_meta_build_allocates_nothing_and_leaves_the_generator_alone():
    cfg = W.config("one")
    state = torch.get_rng_state()
    model = build_model(cfg)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(torch.get_rng_state(), state)
    # given a device and seed, the one-process model: the same values parallelize gives one process
    whole = build_model(cfg, torch.device("cpu"), cfg.seed)
    one = W.held("one")
    assert all(torch.equal(p, one[n][0]) for n, p in whole.named_parameters()) and len(one) == len(whole.state_dict())


def reference(layout: str) -> dict[str, torch.Tensor]:
    """The one-process model (built on meta, materialised whole) whose values a layout must hold."""
    model, parallel, precision = W.LAYOUTS[layout]
    fsdp = parallel.get("zero", 0) >= 2  # FSDP2 keeps fp32 shards even under bf16 (trainer/precision.py)
    name = "one_moe" if model is W.MOE else "one_bf16" if precision == "bf16" and not fsdp else "one"
    return {n: v for n, (v, _, _) in W.held(name).items()}


def launch(tmp: Path, names: list[str]) -> dict[str, list[dict]]:
    world = W.world_of(names[0])
    assert all(W.world_of(n) == world for n in names)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(HERE / "meta_init_worker.py"), str(tmp), *names]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {n: [torch.load(tmp / f"{n}.rank{r}.pt") for r in range(world)] for n in names}


def assert_holds_the_one_process_values(layout: str, ranks: list[dict], ref: dict[str, torch.Tensor]) -> None:
    covered = {n: torch.zeros(v.shape, dtype=torch.bool) for n, v in ref.items()}
    for rank, held in enumerate(ranks):
        assert held.keys() <= ref.keys(), (layout, rank, sorted(held.keys() - ref.keys()))
        for n, (local, offset, shape) in held.items():
            assert shape == tuple(ref[n].shape), (layout, n)
            box = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
            want = ref[n][box]
            assert local.dtype == want.dtype and torch.equal(local, want), (layout, rank, n, offset, tuple(local.shape))
            covered[n][box] = True
    missing = [n for n, c in covered.items() if not c.all()]
    assert not missing, (layout, "values no rank holds", missing)


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_holds_its_slice_of_the_one_process_model(tmp_path):
    torch.set_num_threads(1)
    refs = {n: reference(n) for n in WORLD2 + WORLD4}
    got = {**launch(tmp_path, WORLD2), **launch(tmp_path, WORLD4)}
    for layout, ranks in got.items():
        assert_holds_the_one_process_values(layout, ranks, refs[layout])
    # the shares are shares: tensor parallel holds half of each matrix, the pipeline disjoint layers,
    # expert parallel disjoint experts, FSDP half of every tensor's rows
    tp = got["tp2"][0]
    assert tp["lm_head.weight"][0].shape[0] * 2 == refs["tp2"]["lm_head.weight"].shape[0]
    stage0, stage1 = (set(r) for r in got["pp2"])
    assert stage0.isdisjoint(stage1) and "embed_tokens.weight" in stage0 and "lm_head.weight" in stage1
    experts = [{n for n in r if ".experts." in n} for r in got["ep2"]]
    assert experts[0] and experts[0].isdisjoint(experts[1])
    fsdp = got["fsdp_dp2"][1]["layers.0.mlp.up_proj.weight"]
    assert fsdp[1][0] == fsdp[0].shape[0] == refs["fsdp_dp2"]["layers.0.mlp.up_proj.weight"].shape[0] // 2


@pytest.mark.distributed
@pytest.mark.slow
def test_llama3_70b_width_parallelises_within_each_ranks_share(tmp_path):
    """Llama-3-70B's width with 2 layers (3.8B parameters: 15.3 GB in fp32, 7.6 GB in bf16) at tp=2 x pp=2
    in bf16: each rank holds exactly its share, 1/4 of the bf16 model plus its replicated norm gains
    (1.9 GB), and its peak RSS stays near that, far below the whole model's."""
    import json

    import psutil

    import meta_70b_worker as M

    if psutil.virtual_memory().available < 12 * 2**30:
        pytest.skip("needs ~10 GB free for 4 ranks of 1.9 GB parameters each")
    cfg = M.config()
    whole = {n: p for n, p in build_model(cfg).named_parameters()}
    full_fp32 = sum(p.numel() for p in whole.values()) * 4
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(HERE / "meta_70b_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    stage = {0: {"embed_tokens.weight"} | {n for n in whole if n.startswith("layers.0.")},
             1: {"norm.weight", "lm_head.weight"} | {n for n in whole if n.startswith("layers.1.")}}
    total = 0
    for rec in ranks:
        held = rec["params"]
        assert set(held) == stage[rec["pp_rank"]], rec["rank"]
        # a matrix is split over tp (rows or columns), a norm gain replicated; bf16 is 2 bytes
        share = sum(whole[n].numel() // (2 if whole[n].dim() == 2 else 1) * 2 for n in held)
        assert sum(p["bytes"] for p in held.values()) == share, rec["rank"]
        assert all(p["dtype"] == "torch.bfloat16" and not p["is_meta"] for p in held.values())
        total += share
        grown = rec["peak_rss"] - rec["rss_before"]
        print(f"rank {rec['rank']} (tp {rec['tp_rank']}, pp {rec['pp_rank']}): parameters {share / 1e9:.3f} GB, "
              f"peak RSS {rec['peak_rss'] / 1e9:.3f} GB (+{grown / 1e9:.3f} GB over the process before building); "
              f"whole model {full_fp32 / 1e9:.2f} GB in fp32")
        assert grown < 1.25 * share and rec["peak_rss"] < full_fp32 / 4, rec
        rows = torch.load(tmp_path / f"rows{rec['rank']}.pt")
        for n, (first, last) in rows.items():  # the values are the generator's at the rank's offset
            p, meta = whole[n], held[n]
            std = initial_std(cfg.model, n, p.dim())
            head = fill_initial(torch.empty(first.shape), cfg.seed, n, p.shape, std, meta["offset"])
            tail_at = [meta["offset"][0] + meta["local_shape"][0] - 1, *meta["offset"][1:]]
            tail = fill_initial(torch.empty(last.shape), cfg.seed, n, p.shape, std, tail_at)
            assert torch.equal(first, head.to(first.dtype)) and torch.equal(last, tail.to(last.dtype)), n
    norms = sum(p.numel() * 2 for p in whole.values() if p.dim() == 1)
    assert total == sum(p.numel() * 2 for p in whole.values()) + norms  # each norm gain on both tp ranks
