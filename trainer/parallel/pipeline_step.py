"""One optimizer step through the pipeline schedule.

- Exact accumulation: the loss of a micro-batch on the last stage is its summed cross-entropy times
  D / (target tokens of the whole global batch), D the data-parallel x cp size; the schedule adds the
  micro-batches' gradients unscaled (scale_grads=False), data parallel averages over D, so the step's
  gradient is that of the token-weighted mean, as in `trainer.step.train_step`.
- The gradient norm for clipping is global: squared norms are summed over the pp ranks.
- Data parallel: a bucketed all-reduce of the stage's gradients over dp x cp (grad_all_reduce.py), or,
  under ZeRO-1 (`zero1.DistributedOptimizer`), its reduce-scatter / sharded step / all-gather over the
  same group (the seed's layout: dp=2 x tp=2 x pp=2 with ZeRO-1). Either way a bucket starts reducing
  as soon as the stage's last micro-batch backward has produced its gradients, during the schedule's
  cooldown (hooks counting m backward passes per parameter), and the step waits after the schedule.
  Under ZeRO-2/3 the stage modules are FSDP2 roots and the schedule reduce-scatters after each stage's
  last micro-batch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from infra.config.train import TrainConfig

from .grad_all_reduce import GradAllReduce
from .pipeline import Pipeline
from .zero1 import DistributedOptimizer


def pipeline_train_step(model: nn.Module, optimizer, micro_batches, objective, cfg: TrainConfig, step: int,
                        device: torch.device, dp_group=None, before_update=None):
    """One optimizer step through the pipeline: the schedule runs all micro-batches (forward, loss on
    the last stage, backward), then data-parallel gradient averaging, the global clip and the update.
    `dp_group` is the dp x cp group the token count is agreed over (the loop's argument)."""
    import statistics

    from ..step import StepResult
    from ..precision import autocast_for
    from ..loss import moe_layers
    from ..model.moe import imbalance
    from ..optim import lr_at, set_lr

    pipe: Pipeline = model.pipeline
    model.train()
    data_group = pipe.data_group
    data_size = dist.get_world_size(data_group) if data_group is not None else 1
    tokens = torch.tensor(float(sum(objective.weight(mb) for mb in micro_batches)), device=device)
    if data_group is not None:
        dist.all_reduce(tokens, group=data_group)
    pipe.scale = data_size / float(tokens.clamp_min(1.0))
    pipe.sums = []
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    shard = getattr(objective, "shard", None)  # context parallel cuts the sequence first
    if shard is not None:
        micro_batches = [shard(mb) for mb in micro_batches]
    inputs = torch.cat([mb.inputs for mb in micro_batches]).to(device)
    targets = torch.cat([mb.targets for mb in micro_batches]).to(device)
    moes = moe_layers(model)
    loads = [torch.zeros(m.num_experts, device=device) for m in moes]
    dropped = torch.zeros(len(moes), device=device)
    if moes:  # the schedule calls forward m times; collect each layer's load after every call
        hooks = [m.register_forward_hook(_load_hook(loads, dropped, j, len(micro_batches))) for j, m in enumerate(moes)]
    trace = pipe.trace
    if trace is not None:
        dist.barrier(group=pipe.pp_group)
        t0 = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    # Data parallel starts on each bucket once the stage's m-th backward has filled it (its cooldown).
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.start_grad_sync_after(len(micro_batches))
    elif data_group is not None and not pipe.fsdp:  # FSDP stages reduce-scatter their own (fsdp.py)
        if pipe.grad_sync is None:
            pipe.grad_sync = GradAllReduce([p for p in params if id(p) not in pipe.skip_sync], data_group,
                                           pipe.bucket_elems)
        pipe.grad_sync.start_after(len(micro_batches))
    args = (inputs,) if pipe.has_first else ()
    with autocast_for(cfg.precision, device):  # bf16 matmuls as in the one-stage step
        pipe.schedule.step(*args, target=targets if pipe.has_last else None)
    if trace is not None:
        trace.window = (t0, time.perf_counter())
    if moes:
        for h in hooks:
            h.remove()
    if isinstance(optimizer, DistributedOptimizer):  # ZeRO-1: reduce-scatter, norm over dp, tp, ep and pp
        grad_norm = optimizer.clip_grad_norm(cfg.grad_clip)
    else:
        if pipe.grad_sync is not None:
            pipe.grad_sync.finish()
        grad_norm = model.grad_norm_plan.clip(params, cfg.grad_clip)
    # The schedule's first step also runs the loss once to infer shapes: keep the micro-batches' own.
    sums = torch.stack(pipe.sums[-len(micro_batches):]).sum(dim=0) if pipe.sums else torch.zeros(2, device=device)
    # The spike guard decides on the global loss: every pp rank must agree on skipping.
    logged = pipe.global_sums(sums)
    applied = before_update is None or before_update(logged[0], tokens, grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    sums = logged
    moe_stats: dict[str, float] = {}
    if moes:
        if data_group is not None:
            packed = torch.cat(loads)
            dist.all_reduce(packed, group=data_group)
            loads = list(packed.split([m.num_experts for m in moes]))
        for m, load in zip(moes, loads):
            if m.balance == "bias":
                m.update_bias(load)
        moe_stats = {"moe_imbalance": statistics.fmean(imbalance(x) for x in loads),
                     "moe_dropped": float(dropped.mean())}
    total = float(tokens)
    return StepResult(loss=float(sums[0]) / max(total, 1.0), grad_norm=float(grad_norm), lr=lr, tokens=int(total),
                      z_loss=float(sums[1]) / max(total, 1.0), moe=moe_stats, applied=applied)


def _load_hook(loads, dropped, j, n_micro):
    def hook(module, args, output):
        loads[j] += module.tokens_per_expert.float()
        dropped[j] += module.dropped_fraction / n_micro
    return hook
