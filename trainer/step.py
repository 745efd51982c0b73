"""The one train step. An objective supplies the loss of a micro-batch (language modelling, SFT, DPO,
GRPO: trainer/objectives/); the step owns accumulation, clipping and the optimizer step.

Step (seed: "A replica is responsible for 8 sequences per step but processes only 2 at a time"):
every micro-batch's summed loss is divided by the number of target tokens in the whole step (all
micro-batches, all data-parallel ranks), so the accumulated gradient is that of the token-weighted
mean over the global batch, whatever the split into micro-batches and ranks.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from infra.config.train import TrainConfig

from .data import MicroBatch
from .loss import TokenLoss, moe_aux_loss, moe_layers
from .model.moe import imbalance
from .optim import clip_grad_norm, lr_at, set_lr
from .parallel.ddp import unwrap
from .parallel.fsdp import skip_grad_sync
from .parallel.zero1 import DistributedOptimizer
from .precision import autocast_for


class Objective(Protocol):
    """What a training method supplies: how many loss units (target tokens, pairs ...) a micro-batch
    holds, known before the forward so the step's normaliser can be agreed on first, and the summed
    loss of one micro-batch."""

    def weight(self, batch: MicroBatch) -> int: ...

    def loss(self, model: nn.Module, batch: MicroBatch, device: torch.device) -> TokenLoss: ...


@dataclass
class StepResult:
    loss: float  # token-weighted mean cross-entropy over the global batch
    grad_norm: float  # before clipping
    lr: float
    tokens: int  # target tokens over the global batch
    z_loss: float = 0.0
    aux_loss: float = 0.0
    moe: dict[str, float] = field(default_factory=dict)
    applied: bool = True  # False when the spike guard skipped the optimizer step (trainer.recovery)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    objective: Objective,
    cfg: TrainConfig,
    step: int,
    device: torch.device,
    dp_group=None,
    before_update=None,
) -> StepResult:
    """One optimizer step over this rank's micro-batches (see the module docstring)."""
    if getattr(unwrap(model), "pipeline", None) is not None:  # pipeline parallel: the schedule runs the passes
        from .parallel.pipeline_step import pipeline_train_step

        return pipeline_train_step(unwrap(model), optimizer, micro_batches, objective, cfg, step, device, dp_group,
                                   before_update)
    model.train()
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    n_micro = len(micro_batches)
    tokens = torch.tensor(float(sum(objective.weight(mb) for mb in micro_batches)), device=device)
    if dp_group is not None:
        dist.all_reduce(tokens, group=dp_group)
    # DDP averages gradients over ranks; multiplying by dp_size turns that average into the sum.
    scale = dp_size / tokens.clamp_min(1.0)
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    inner = unwrap(model)
    moes = moe_layers(inner)
    loads = [torch.zeros(m.num_experts, device=device) for m in moes]
    dropped = torch.zeros(len(moes), device=device)
    sums = torch.zeros(3, device=device)  # ce, z, aux
    for i, mb in enumerate(micro_batches):
        last = i == n_micro - 1
        sync = contextlib.nullcontext() if last else skip_grad_sync(model)  # DDP no_sync / FSDP2
        with sync:
            with autocast_for(cfg.precision, device):
                part = objective.loss(model, mb, device)
            loss = part.total * scale
            aux = moe_aux_loss(inner)
            if aux is not None:
                loss = loss + aux / n_micro  # mean over micro-batches (and over ranks, by DDP)
            if last and isinstance(optimizer, DistributedOptimizer):
                optimizer.start_grad_sync_after(1)  # ZeRO-1: each bucket reduce-scatters once this backward fills it
            loss.backward()
        sums += torch.stack([part.ce_sum.detach(), part.z_sum.detach(),
                             aux.detach() / n_micro if aux is not None else torch.zeros((), device=device)])
        for j, m in enumerate(moes):
            loads[j] += m.tokens_per_expert.float()
            dropped[j] += m.dropped_fraction / n_micro
    if isinstance(optimizer, DistributedOptimizer):  # ZeRO-1: reduce-scatter, then the norm over shards
        grad_norm = optimizer.clip_grad_norm(cfg.grad_clip)
    else:
        norm_plan = getattr(inner, "grad_norm_plan", None)  # set when a rank holds part of the parameters (EP)
        grad_norm = (clip_grad_norm(model.parameters(), cfg.grad_clip) if norm_plan is None
                     else norm_plan.clip(model.parameters(), cfg.grad_clip))
    # before_update(ce_sum, tokens, grad_norm) -> bool: the spike guard may skip this update.
    applied = before_update is None or before_update(sums[0], tokens, grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    if dp_group is not None:  # one all-reduce for the logged sums and every MoE layer's load
        packed = torch.cat([sums, *loads])
        dist.all_reduce(packed, group=dp_group)
        sums = packed[:3]
        loads = list(packed[3:].split([m.num_experts for m in moes])) if moes else []
    moe_stats: dict[str, float] = {}
    if moes:
        for m, load in zip(moes, loads):
            if m.balance == "bias":
                m.update_bias(load)  # the same summed load on every rank keeps the biases identical
        moe_stats = {
            "moe_imbalance": statistics.fmean(imbalance(load) for load in loads),
            "moe_dropped": float(dropped.mean()),  # this rank's micro-batches
        }
    total_tokens = float(tokens)
    return StepResult(
        loss=float(sums[0]) / max(total_tokens, 1.0),
        grad_norm=float(grad_norm),
        lr=lr,
        tokens=int(total_tokens),
        z_loss=float(sums[1]) / max(total_tokens, 1.0),
        aux_loss=float(sums[2]) / dp_size,
        moe=moe_stats,
        applied=applied,
    )
