"""Runs parallel layouts of a tiny model on the same global batches and records, per layout: losses
and gradient norms under AdamW and SGD, the final full weights under SGD, one step's collectives
(CommCounter) and the optimizer-state bytes. Used in-process for the one-process reference and under
torchrun for every layout of one world size in a single launch (process start + gloo init is the cost).

    python -m torch.distributed.run --nproc-per-node=W par1_worker.py OUT.pt LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from trainer.activation_stats import ActivationStats
from trainer.data import MicroBatch
from trainer.meta_init import build_model
from trainer.objectives import LanguageModelling
from trainer.parallel.ddp import unwrap
from trainer.step import train_step
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.comm_accounting import CommCounter
from trainer.parallel.zero1 import build_parallel_optimizer, optimizer_state_bytes

VOCAB, SEQ, GLOBAL, MICRO, STEPS = 320, 16, 8, 2, 5  # tokenizer.vocab_size >= 300
DATA_SEED = int(os.environ.get("PAR1_DATA_SEED", 1000))  # other values: the margin measurements of QUALITY_ASSERTIONS.md
ACTS_STEP = 2  # the step whose per-layer activation statistics are recorded (not the collectives-counted one)

# name -> parallel: overrides (world size = dp * tp)
LAYOUTS = {
    "one": {},
    "ddp2": {"dp": 2},
    "zero1_dp2": {"dp": 2, "zero": 1},
    "zero1_dp4": {"dp": 4, "zero": 1},
    "zero2_dp2": {"dp": 2, "zero": 2},
    "zero3_dp4": {"dp": 4, "zero": 3},
    "hsdp_2x2": {"dp": 4, "zero": 3, "dp_replicate": 2},
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "tp2_zero1_dp2": {"tp": 2, "dp": 2, "zero": 1},
    "ddp4": {"dp": 4},
    "tp2_fsdp_dp2": {"tp": 2, "dp": 2, "zero": 3},  # TP inside FSDP on a 2-D (dp_shard, tp) mesh
    "zero1_dp2_fp32acc": {"dp": 2, "zero": 1},  # bf16 only: with pretrain.fp32_grad_accum (TRAIN below)
}
TRAIN = {"zero1_dp2_fp32acc": {"fp32_grad_accum": True}}  # pretrain: overrides
BF16 = "_bf16"  # a layout's name with this suffix: the same layout with pretrain.precision bf16
MTP = "_mtp"  # ... with this one: the model with 2 multi-token-prediction depths (trainer/model/mtp.py)


def layout(name: str) -> dict:
    return LAYOUTS[name.removesuffix(BF16).removesuffix(MTP)]


def world_of(name: str) -> int:
    p = layout(name)
    return p.get("dp", 1) * p.get("tp", 1)


def config(name: str, optimizer: str, bucket_mb: float = 0.02) -> LifecycleConfig:
    p = {"nproc_per_node": world_of(name), "bucket_mb": bucket_mb, **layout(name)}
    return LifecycleConfig.model_validate({
        "name": "par1", "seed": 0,
        "model": {"vocab_size": VOCAB, "dim": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                  "max_seq_len": 32, "qk_norm": True, "z_loss": 1e-3,  # b*s = 32 != h = 48
                  "mtp_depth": 2 if name.endswith(MTP) else 0},
        "tokenizer": {"vocab_size": VOCAB},
        "parallel": p,
        "pretrain": {"steps": STEPS, "seq_len": SEQ, "micro_batch_size": MICRO, "global_batch_size": GLOBAL,
                     "lr": 1e-2 if optimizer == "adamw" else 0.5, "warmup_steps": 1, "optimizer": optimizer,
                     "precision": "bf16" if name.endswith(BF16) else "fp32", "grad_clip": 1.0, "peak_flops": 1e11,
                     **TRAIN.get(name.removesuffix(BF16), {})},
    })


def global_rows(step: int) -> torch.Tensor:
    """The step's global batch [GLOBAL, SEQ + 1]: a learnable pattern (a fixed random walk over the
    vocabulary) so losses fall, the same on every rank and layout."""
    g = torch.Generator().manual_seed(DATA_SEED + step)
    start = torch.randint(0, VOCAB, (GLOBAL, 1), generator=g)
    steps = torch.randint(1, 4, (GLOBAL, SEQ + 1), generator=g).cumsum(1)
    return (start + steps) % VOCAB


def micro_batches(step: int, dp_rank: int, dp: int) -> list[MicroBatch]:
    rows = global_rows(step)
    per = GLOBAL // dp
    mine = rows[dp_rank * per:(dp_rank + 1) * per]
    return [MicroBatch(inputs=mine[i:i + MICRO, :-1], targets=mine[i:i + MICRO, 1:], rows=None)
            for i in range(0, per, MICRO)]


def full_state(model) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in unwrap(model).state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k.replace("_orig_mod.", "")] = v.detach().clone()
    return out


def run(name: str, optimizer: str, count_step: int | None = None) -> dict:
    cfg = config(name, optimizer)
    t = cfg.pretrain
    dims = build_parallel_dims(cfg.parallel, "cpu")
    model = parallelize(build_model(cfg), dims, cfg.parallel, t, device=torch.device("cpu"), seed=cfg.seed)
    opt = build_parallel_optimizer(unwrap(model), dims, cfg.parallel, t)
    objective = LanguageModelling(z_loss=cfg.model.z_loss, mtp_depth=cfg.model.mtp_depth,
                                  mtp_weight=t.mtp_loss_weight)
    dp_group = dims.group("dp")
    losses, norms, mtp, comm = [], [], [], None
    stats = ActivationStats(unwrap(model), cfg.model.n_layers, torch.device("cpu"))
    for step in range(t.steps):
        micro = micro_batches(step, dims.rank("dp"), dims.dp)
        if step == ACTS_STEP:
            stats.start()
            res = train_step(model, opt, micro, objective, t, step, torch.device("cpu"), dp_group)
            acts = stats.finish()
        elif step == count_step:
            with CommCounter(dims.group_names()) as counter:
                res = train_step(model, opt, micro, objective, t, step, torch.device("cpu"), dp_group)
            comm = [r.__dict__ | {"wire_bytes": r.wire_bytes} for r in counter.records]
        else:
            res = train_step(model, opt, micro, objective, t, step, torch.device("cpu"), dp_group)
        losses.append(res.loss)
        mtp.append(res.mtp)
        norms.append(res.grad_norm)
    out = {"losses": losses, "grad_norms": norms, "mtp": mtp, "comm": comm, "acts": acts, "state_bytes": optimizer_state_bytes(opt),
           "n_micro": len(micro), "params": sum(p.numel() for p in unwrap(model).parameters())}
    if optimizer == "sgd":
        out["state"] = full_state(model)
    return out


def run_all(names: list[str]) -> dict:
    """AdamW (losses, one step's collectives) and SGD (weights) per layout; the bf16 layouts and the
    dp=4 DDP baseline (accounting and memory only) AdamW only."""
    return {n: {"adamw": run(n, "adamw", count_step=1),
                **({} if n.endswith(BF16) or n == "ddp4" else {"sgd": run(n, "sgd")})} for n in names}


def main(out_file: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        results = run_all(names)
        if dist.get_rank() == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
