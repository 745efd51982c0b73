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
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from infra.config.train import TrainConfig

from .data import MicroBatch
from .loss import TokenLoss, moe_aux_loss, moe_layers
from .model.moe import imbalance
from .optim import clip_grad_norm, lr_at, set_lr
from .parallel.ddp import unwrap
from .parallel.fsdp import skip_grad_sync
from .parallel.pipeline import is_pipelined
from .parallel.pipeline_step import PipelinePasses
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
    mtp: dict[str, float] = field(default_factory=dict)  # mtp_loss_k: depth k's mean cross-entropy (model/mtp.py)
    applied: bool = True  # False when the spike guard skipped the optimizer step (trainer.recovery)


class MicroBatchPasses(Protocol):
    """How a step's micro-batches go through the model: one after another on this rank (`LocalPasses`)
    or through the pipeline schedule (parallel/pipeline_step.PipelinePasses). Everything else in the
    step (the token count, the loss scale, the LR, clipping, the spike guard, the update, the MoE
    loads) is the same for both and lives in `train_step`."""

    data_group: object  # the ranks that share weights: tokens, gradients and sums are agreed over them

    def forward_backward(self, micro_batches: list[MicroBatch], objective: Objective, scale: torch.Tensor,
                         cfg: TrainConfig, device: torch.device, optimizer, moes: list, loads: list[torch.Tensor],
                         dropped: torch.Tensor) -> torch.Tensor:
        """Every micro-batch's forward and backward with its summed loss times `scale`, starting the
        gradients' data-parallel reduction as they become ready; adds each MoE layer's expert loads and
        dropped fraction into `loads` and `dropped`. Returns this rank's summed losses."""

    def clip(self, max_norm: float) -> torch.Tensor:
        """Finish the gradient reduction, clip to `max_norm` by the global norm, return the norm."""

    def share_loss(self, sums: torch.Tensor) -> torch.Tensor:
        """The sums the spike guard sees (between the backward and the update)."""

    def reduce_metrics(self, sums: torch.Tensor, loads: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """[ce, z, aux] and the MoE loads summed over the data group, after the update."""


class LocalPasses:
    """Every micro-batch's forward and backward on this rank, one after another: one process, DDP,
    FSDP2, ZeRO-1, tensor, context and expert parallel. Gradients sync in the last micro-batch's
    backward only (DDP no_sync / FSDP2, ZeRO-1's buckets)."""

    def __init__(self, model: nn.Module, dp_group=None):
        self.model, self.data_group = model, dp_group

    def forward_backward(self, micro_batches, objective, scale, cfg, device, optimizer, moes, loads, dropped):
        model, inner = self.model, unwrap(self.model)
        n_micro = len(micro_batches)
        depth = getattr(objective, "mtp_depth", 0)
        sums = torch.zeros(3 + 2 * depth, device=device)  # ce, z, aux (+ each MTP depth's ce sums, then counts)
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
            sums[:3] += torch.stack([part.ce_sum.detach(), part.z_sum.detach(),
                                     aux.detach() / n_micro if aux is not None else torch.zeros((), device=device)])
            if depth:
                sums[3:] += part.mtp_sums.flatten()
            # Read after the backward, not in a forward hook: activation checkpointing reruns the forward.
            for j, m in enumerate(moes):
                loads[j] += m.tokens_per_expert.float()
                dropped[j] += m.dropped_fraction / n_micro
        return sums

    def clip(self, max_norm):
        norm_plan = getattr(unwrap(self.model), "grad_norm_plan", None)  # set when a rank holds part of the parameters (EP)
        return (clip_grad_norm(self.model.parameters(), max_norm) if norm_plan is None
                else norm_plan.clip(self.model.parameters(), max_norm))

    def share_loss(self, sums):
        return sums  # this rank's: the spike guard reduces it over the data group itself

    def reduce_metrics(self, sums, loads):
        if self.data_group is None:
            return sums, loads
        packed = torch.cat([sums, *loads])  # one all-reduce for the logged sums and every MoE layer's load
        dist.all_reduce(packed, group=self.data_group)
        n = sums.numel()
        return packed[:n], list(packed[n:].split([x.numel() for x in loads])) if loads else []


def check_gradients_are_averaged(model: nn.Module, optimizer, group) -> None:
    """Ranks of one data group must average their gradients (DDP, FSDP2 or ZeRO-1 does it). A plain optimizer
    on an unwrapped model would let each rank train on its own micro-batches and the replicas drift apart
    without an error: refused (e.g. parallel.zero=1 with trainer.optim.build_optimizer, where
    parallel.zero1.build_parallel_optimizer is needed)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    if isinstance(model, (DistributedDataParallel, FSDPModule)) or isinstance(optimizer, DistributedOptimizer):
        return
    raise ValueError(
        f"train_step: {dist.get_world_size(group)} data-parallel ranks, but neither the model ({type(model).__name__}: "
        f"not DDP or FSDP) nor the optimizer ({type(optimizer).__name__}: not ZeRO-1's DistributedOptimizer) "
        "averages their gradients; build the optimizer with parallel.zero1.build_parallel_optimizer")


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
    """One optimizer step over this rank's micro-batches (see the module docstring). `dp_group`: the
    ranks the token count and the sums are agreed over (dp, or dp x cp under context parallel); a
    pipelined model uses its own, the same group (parallel/pipeline.py)."""
    inner = unwrap(model)
    passes: MicroBatchPasses = PipelinePasses(inner) if is_pipelined(inner) else LocalPasses(model, dp_group)
    model.train()
    group = passes.data_group
    if not is_pipelined(inner):
        check_gradients_are_averaged(model, optimizer, group)
    data_size = dist.get_world_size(group) if group is not None else 1
    tokens = torch.tensor(float(sum(objective.weight(mb) for mb in micro_batches)), device=device)
    if group is not None:
        dist.all_reduce(tokens, group=group)
    # Data parallel averages gradients over ranks; multiplying by data_size turns that average into the sum.
    scale = data_size / tokens.clamp_min(1.0)
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    moes = moe_layers(inner)
    loads = [torch.zeros(m.num_experts, device=device) for m in moes]
    dropped = torch.zeros(len(moes), device=device)
    sums = passes.forward_backward(micro_batches, objective, scale, cfg, device, optimizer, moes, loads, dropped)
    if isinstance(optimizer, DistributedOptimizer):  # ZeRO-1: reduce-scatter, then the norm over shards
        grad_norm = optimizer.clip_grad_norm(cfg.grad_clip)
    else:
        grad_norm = passes.clip(cfg.grad_clip)
    sums = passes.share_loss(sums)
    # before_update(ce_sum, tokens, grad_norm) -> bool: the spike guard may skip this update.
    applied = before_update is None or before_update(sums[0], tokens, grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    sums, loads = passes.reduce_metrics(sums, loads)
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
    depth = (sums.numel() - 3) // 2
    mtp = {f"mtp_loss_{k + 1}": float(sums[3 + k]) / max(float(sums[3 + depth + k]), 1.0) for k in range(depth)}
    return StepResult(
        loss=float(sums[0]) / max(total_tokens, 1.0),
        grad_norm=float(grad_norm),
        lr=lr,
        tokens=int(total_tokens),
        z_loss=float(sums[1]) / max(total_tokens, 1.0),
        aux_loss=float(sums[2]) / data_size,
        moe=moe_stats,
        mtp=mtp,
        applied=applied,
    )
