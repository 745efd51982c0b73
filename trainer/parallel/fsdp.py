"""ZeRO-2, ZeRO-3 and HSDP through FSDP2 (`fully_shard`, per parameter sharding, seed: "PyTorch's FSDP2
(the basis of TorchTitan) shards per parameter").

Each transformer block is one FSDP unit (its parameters all-gathered together just before its
forward), then the root (embedding, final norm, LM head); a module that holds Transformers (a reward
model's trunk) gets each of them as a unit too, and its root the rest (a head). `reshard_after_forward` is the stage
switch: False keeps the gathered weights from forward to backward (ZeRO-2: gradients and optimizer
state sharded, weights gathered once per step); True frees them and gathers again in backward
(ZeRO-3: "1.5x the traffic of plain data parallelism"). On a 2-D (dp_replicate, dp_shard) mesh FSDP2
shards inside dp_shard and replicates across dp_replicate (HSDP). Under tensor parallel the
parameters are already DTensors on the tp mesh and FSDP2 shards them further over dp (2-D/3-D).
Under pipeline parallel the stage modules are the FSDP roots (see `apply_fsdp`).

Gradients stay sharded through accumulation (seed: ZeRO-2 "each bucket is reduce-scattered straight
into its owner and the rest is freed"): every micro-batch's backward reduce-scatters each unit's
gradient as it is produced, overlapped with the earlier units' backward, and FSDP2 adds it into the
fp32 gradient shard. The price is one reduce-scatter per micro-batch: per step, with m micro-batches
and N bytes of gradient, ZeRO-2 moves (m + 1)/2 of DDP's 2(d-1)/d N (m reduce-scatters, one
all-gather) and ZeRO-3 3m/2 of it (a gather in forward and in backward, and a reduce-scatter, per
micro-batch). Holding unsharded gradients until the last micro-batch (set_requires_gradient_sync(False))
would move less but keeps a full gradient per rank, which is ZeRO-1's memory, not ZeRO-2's.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..precision import LOW_PRECISION
from .mesh import ParallelDims
from .model_parts import transformers_of


def dp_mesh(dims: ParallelDims):
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        return dims.submesh("dp_replicate", "dp_shard")
    if dims.dp_shard > 1:
        return dims.submesh("dp_shard")
    raise ValueError(f"FSDP needs dp_shard > 1 (got dp_replicate={dims.dp_replicate}, dp_shard={dims.dp_shard})")


def apply_fsdp(model: nn.Module, dims: ParallelDims, zero: int, precision: str, reduce_fp32: bool = False) -> nn.Module:
    if zero not in (2, 3):
        raise ValueError(f"apply_fsdp: zero={zero}; FSDP implements stages 2 and 3")
    mesh = dp_mesh(dims)
    # bf16: fp32 parameter shards are the masters; weights all-gathered and computed in bf16; gradients
    # reduce-scattered in bf16 (the seed's 2 bytes), or fp32 with `fp32_grad_accum` (Megatron's
    # grad_reduce_in_fp32), and kept as fp32 shards for the optimizer.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                               reduce_dtype=torch.float32 if reduce_fp32 else torch.bfloat16)
          if precision in LOW_PRECISION else MixedPrecisionPolicy())
    reshard = zero == 3
    for trunk in transformers_of(model):  # the model, or each Transformer it holds (model_parts.py)
        for block in [*trunk.layers.values(), *(trunk.mtp or ())]:  # + the MTP modules (model/mtp.py), one unit each
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        if trunk is not model:  # a held Transformer's embedding, norm and head: its own unit, gathered for its forward
            fully_shard(trunk, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    pipe = getattr(model, "pipeline", None)
    if pipe is not None:
        # Pipeline parallel: each stage module is an FSDP root (its embedding / norm / head the root unit);
        # torch's schedules then hold the reduce-scatter until a stage's last micro-batch
        # (PipelineStage.backward_maybe_with_nosync / perform_reduce_grad), so the pipeline step
        # needs no data-parallel all-reduce of its own.
        for part in pipe.parts:
            fully_shard(part, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        pipe.fsdp = True
        return model
    # The root (embedding, final norm, LM head; a module holding Transformers: what it has outside them) follows
    # the same switch, so ZeRO-3 moves exactly the seed's 1.5x of DDP (TorchTitan keeps the root gathered: the
    # LM head is the first used in backward).
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # ZeRO-2 keeps the gathered weights between the micro-batches of a step as well (skip_grad_sync).
    model.keep_gathered_for_accumulation = zero == 2
    return model


@contextlib.contextmanager
def skip_grad_sync(model: nn.Module):
    """A micro-batch before the step's last: DDP accumulates locally (`no_sync()`: its buffers are
    whole anyway, one all-reduce per step); FSDP2 still reduce-scatters, so gradients stay sharded
    (see the module docstring), and under ZeRO-2 keeps the weights gathered for the next micro-batch;
    nothing for unwrapped models (ZeRO-1 communicates in its last backward and its step)."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule) and getattr(model, "keep_gathered_for_accumulation", False):
        model.set_reshard_after_backward(False)  # ZeRO-2: no re-gather before the next micro-batch's forward
        try:
            yield
        finally:
            model.set_reshard_after_backward(True)
    else:
        yield
