"""Validation loss of a pipelined model, without a schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..loss import cross_entropy_sum
from ..precision import LOW_PRECISION, autocast_for
from .pipeline import Pipeline
from .pipeline_split import chunks_of_rank


@torch.no_grad()
def pipeline_evaluate(model: nn.Module, batches, objective, device: torch.device, precision: str = "fp32") -> float:
    """Token-weighted validation cross-entropy: each batch walks the chunks in order, the hidden
    states sent point to point between the ranks holding consecutive chunks (no schedule: evaluation
    is rare and every schedule, zero-bubble ones included, shares this path)."""
    pipe: Pipeline = model.pipeline
    pp_rank = dist.get_rank(pipe.pp_group)
    pp = dist.get_world_size(pipe.pp_group)
    n_chunks = len(pipe.counts)
    virtual = n_chunks // pp
    owner = {c: r for r in range(pp) for c in chunks_of_rank(r, pp, virtual, pipe.schedule_name)}
    local = dict(zip(pipe.chunk_ids, pipe.parts))
    shard = getattr(objective, "shard", None)
    wire = torch.bfloat16 if precision in LOW_PRECISION else torch.float32  # hidden states between stages
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, device=device)  # ce, z, tokens
    for mb in batches:
        mb = shard(mb) if shard is not None else mb
        h = None
        for c in range(n_chunks):
            if owner[c] != pp_rank:
                continue
            if c == 0:
                h = mb.inputs.to(device)
            elif owner[c - 1] != pp_rank:
                b, seq = mb.inputs.shape
                h = torch.empty(b, seq // pipe.sequence_shards, model.cfg.dim, device=device, dtype=wire)
                dist.recv(h, dist.get_global_rank(pipe.pp_group, owner[c - 1]), group=pipe.pp_group)
            with autocast_for(precision, device):
                h = local[c](h)
            if c == n_chunks - 1:
                part = cross_entropy_sum(h, mb.targets.to(device), z_loss=pipe.z_loss)
                sums += torch.stack([part.ce_sum.float(), part.z_sum.float(), part.tokens.float()])
            elif owner[c + 1] != pp_rank:
                dist.send(h.to(wire).contiguous(), dist.get_global_rank(pipe.pp_group, owner[c + 1]), group=pipe.pp_group)
    model.train(was_training)
    sums = pipe.global_sums(sums)
    return float(sums[0] / sums[2].clamp_min(1.0))
