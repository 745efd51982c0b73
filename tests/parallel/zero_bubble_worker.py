"""Worker of test_zero_bubble_fp32_grads.py (torchrun, 4 ranks: dp=2 x pp=2, gloo): ZeRO-1 in bf16 with
fp32 gradient accumulation under each pipeline schedule named on the command line, the same model, batches
and seed; rank 0 writes every schedule's losses and gradient norms as JSON to argv[1]."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from trainer.data import MicroBatch
from trainer.meta_init import build_model
from trainer.objectives import LanguageModelling
from trainer.step import train_step
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.zero1 import build_parallel_optimizer

STEPS, VOCAB, SEQ, BATCH, MICRO = 3, 320, 32, 16, 2


def config(schedule: str, fp32_grad_accum: bool) -> LifecycleConfig:
    virtual = 1 if schedule == "1f1b" else 2
    return LifecycleConfig.model_validate({
        "name": "zero-bubble-fp32-grads", "seed": 0,
        "model": {"vocab_size": VOCAB, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                  "max_seq_len": SEQ},
        "tokenizer": {"vocab_size": VOCAB},
        "parallel": {"nproc_per_node": 4, "dp": 2, "pp": 2, "zero": 1, "pp_schedule": schedule,
                     "pp_virtual_stages": virtual},
        "pretrain": {"steps": STEPS, "seq_len": SEQ, "micro_batch_size": MICRO, "global_batch_size": BATCH,
                     "lr": 1e-3, "warmup_steps": 0, "precision": "bf16", "fp32_grad_accum": fp32_grad_accum,
                     "peak_flops": 1e11},
    })


def batches(step: int, dp_rank: int, dp: int) -> list[MicroBatch]:
    rows = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    per = BATCH // dp
    mine = rows[dp_rank * per:(dp_rank + 1) * per]
    return [MicroBatch(mine[i:i + MICRO, :-1], mine[i:i + MICRO, 1:], None) for i in range(0, per, MICRO)]


def run(schedule: str, fp32_grad_accum: bool) -> dict:
    cfg = config(schedule, fp32_grad_accum)
    dims = build_parallel_dims(cfg.parallel, "cpu")
    cpu = torch.device("cpu")
    model = parallelize(build_model(cfg), dims, cfg.parallel, cfg.pretrain, device=cpu, seed=cfg.seed)
    opt = build_parallel_optimizer(model, dims, cfg.parallel, cfg.pretrain)
    losses, norms = [], []
    for step in range(STEPS):
        r = train_step(model, opt, batches(step, dims.rank("dp"), dims.dp), LanguageModelling(), cfg.pretrain, step,
                       cpu, dims.group("dp"))
        losses.append(r.loss)
        norms.append(r.grad_norm)
    return {"losses": losses, "grad_norms": norms}


def main(out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        found = {}
        for name in names:  # "zbv" (fp32 gradient accumulation) or "zbv:bf16" (bf16 gradients)
            schedule, _, grads = name.partition(":")
            found[name] = run(schedule, grads != "bf16")
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(found, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
