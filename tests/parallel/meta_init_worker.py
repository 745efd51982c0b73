"""Builds a model on the meta device, parallelises it and materialises each rank's share, for every
layout of one world size in one launch; saves per rank and layout what it holds: for every parameter
and buffer (full-model names) the local values, their offset in the whole tensor and its shape.
Used in-process for the one-process reference. Run by test_meta_init.py:

    python -m torch.distributed.run --nproc-per-node=W meta_init_worker.py OUT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from trainer.meta_init import build_model
from trainer.parallel.ddp import unwrap
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.materialize import local_shard

SEED = 7
DENSE = {"vocab_size": 320, "dim": 48, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 78,
         "max_seq_len": 32, "qk_norm": True}  # ffn 78: FSDP splits 39 rows of a TP block 20 + 19
MOE = {**DENSE, "n_layers": 2, "moe": {"num_experts": 4, "top_k": 2, "balance": "bias", "shared_expert": True}}

# name -> (model, parallel overrides, precision)
LAYOUTS = {
    "one": (DENSE, {}, "fp32"),
    "one_moe": (MOE, {}, "fp32"),
    "one_bf16": (DENSE, {}, "bf16"),
    "ddp2": (DENSE, {"dp": 2}, "fp32"),
    "tp2": (DENSE, {"tp": 2}, "fp32"),
    "tp2_bf16": (DENSE, {"tp": 2, "sequence_parallel": True}, "bf16"),
    "pp2": (DENSE, {"pp": 2, "pp_split": [3, 1]}, "fp32"),
    "fsdp_dp2": (DENSE, {"dp": 2, "zero": 3}, "fp32"),
    "ep2": (MOE, {"dp": 2, "ep": 2}, "fp32"),
    "tp2_pp2": (DENSE, {"tp": 2, "pp": 2}, "bf16"),
    "tp2_fsdp_dp2": (DENSE, {"tp": 2, "dp": 2, "zero": 3}, "fp32"),  # 2-D: FSDP rows of TP blocks
    "pp2_fsdp_dp2": (DENSE, {"pp": 2, "dp": 2, "zero": 2}, "bf16"),  # stage modules are the FSDP roots
    "tp2_ep2": (MOE, {"tp": 2, "dp": 2, "ep": 2, "zero": 1}, "fp32"),
}


def world_of(name: str) -> int:
    p = LAYOUTS[name][1]
    return p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1)


def config(name: str) -> LifecycleConfig:
    model, parallel, precision = LAYOUTS[name]
    return LifecycleConfig.model_validate({
        "name": "meta-init", "seed": SEED, "model": model, "tokenizer": {"vocab_size": 320},
        "parallel": {"nproc_per_node": world_of(name), **parallel},
        "pretrain": {"steps": 1, "warmup_steps": 0, "seq_len": 16, "micro_batch_size": 2, "global_batch_size": 8, "precision": precision},
    })


def held(name: str) -> dict:
    """What this rank holds after parallelize: name -> (local values, offset, full shape)."""
    cfg = config(name)
    dims = build_parallel_dims(cfg.parallel, "cpu")
    model = unwrap(parallelize(build_model(cfg), dims, cfg.parallel, cfg.pretrain, device=torch.device("cpu"),
                               seed=cfg.seed))
    out = {}
    for n, p in model.named_parameters():
        local, offset = local_shard(p)
        out[n] = (local.detach().clone(), offset or (0,) * p.dim(), tuple(p.shape))
    for n, b in model.named_buffers():
        out[n] = (b.detach().clone(), (0,) * b.dim(), tuple(b.shape))
    return out


def main(out_dir: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    try:
        for name in names:
            torch.save(held(name), Path(out_dir) / f"{name}.rank{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
