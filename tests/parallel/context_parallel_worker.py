"""Run under torchrun by test_context_parallel.py: ring attention on the zigzag shards of one fixed
batch, in three precisions (fp32 tensors; bf16 tensors; fp32 tensors under bf16 autocast), forward and
backward, counting every send through the project's CommCounter. Rank 0 saves the full-sequence
outputs and q/k/v gradients (gathered and unsharded) and every rank's sends.

    python -m torch.distributed.run --nproc-per-node=CP context_parallel_worker.py OUT.pt
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.parallel.comm_accounting import CommCounter
from trainer.parallel.context_parallel import RingAttention, zigzag_shard, zigzag_unshard

B, H, K, S, D = 2, 4, 2, 64, 16  # batch, query heads, KV heads (GQA: 2 query heads per KV head), sequence, head size


def inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v, dO: the same on every rank, with values exact in bf16 so every precision sees the same inputs."""
    g = torch.Generator().manual_seed(int(os.environ.get("RING_SEED", "0")))  # RING_SEED: to measure margins
    return tuple(torch.randn(B, h, S, D, generator=g).bfloat16().float() for h in (H, K, K, H))


def gather(t: torch.Tensor, cp: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous())
    return zigzag_unshard(parts, dim=2)


def run(precision: str, cp: int, rank: int) -> dict:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    q, k, v, d_out = (zigzag_shard(x, cp, rank, dim=2).to(dtype) for x in inputs())
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    with CommCounter({dist.group.WORLD.group_name: "cp"}) as counter:
        with autocast:
            out = RingAttention(dist.group.WORLD)(q, k, v)  # the model's attention_fn under cp
        out.backward(d_out)
    sends = [{"elements": r.elements, "element_size": r.element_size, "backward": r.backward, "dim": r.dim}
             for r in counter.records if r.kind == "send"]
    return {"out": gather(out.detach(), cp), "dq": gather(q.grad, cp), "dk": gather(k.grad, cp),
            "dv": gather(v.grad, cp), "sends": sends, "other": [r.kind for r in counter.records if r.kind != "send"]}


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        cp, rank = dist.get_world_size(), dist.get_rank()
        res = {p: run(p, cp, rank) for p in ("fp32", "bf16", "autocast")}
        every = [None] * cp
        dist.all_gather_object(every, {p: r["sends"] for p, r in res.items()})
        if rank == 0:
            for p, r in res.items():
                r["sends"] = [e[p] for e in every]
            torch.save({"cp": cp, "shape": (B, H, K, S, D), **res}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
