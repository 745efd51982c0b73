"""The forward and backward passes of one step's micro-batches through the pipeline schedule.

- Exact accumulation: the loss of a micro-batch on the last stage is its summed cross-entropy times
  D / (target tokens of the whole global batch), D the data-parallel x cp size; the schedule adds the
  micro-batches' gradients unscaled (scale_grads=False), data parallel averages over D, so the step's
  gradient is that of the token-weighted mean, as for one stage (trainer/step.py: LocalPasses).
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

from ..precision import autocast_for
from .grad_all_reduce import GradAllReduce
from .zero1 import DistributedOptimizer


class PipelinePasses:
    """A step's micro-batches through the pipeline schedule: the schedule runs every forward, the loss
    on the last stage and every backward (trainer/step.py's MicroBatchPasses; the step around it is
    `train_step`'s). Tokens and sums are agreed over the pipeline's own data group (dp x cp)."""

    def __init__(self, model: nn.Module):
        self.model, self.pipe = model, model.pipeline
        self.data_group = self.pipe.data_group
        self.params: list[torch.Tensor] = []

    def forward_backward(self, micro_batches, objective, scale, cfg: TrainConfig, device: torch.device, optimizer,
                         moes, loads, dropped) -> torch.Tensor:
        pipe = self.pipe
        pipe.scale = float(scale)  # the last stage's loss_fn multiplies each micro-batch's summed loss by it
        pipe.sums = []
        shard = getattr(objective, "shard", None)  # context parallel cuts the sequence first
        if shard is not None:
            micro_batches = [shard(mb) for mb in micro_batches]
        inputs = torch.cat([mb.inputs for mb in micro_batches]).to(device)
        targets = torch.cat([mb.targets for mb in micro_batches]).to(device)
        if moes:  # the schedule calls forward m times; collect each layer's load after every call
            hooks = [m.register_forward_hook(_load_hook(loads, dropped, j, len(micro_batches))) for j, m in enumerate(moes)]
        trace = pipe.trace
        if trace is not None:
            dist.barrier(group=pipe.pp_group)
            t0 = time.perf_counter()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Data parallel starts on each bucket once the stage's m-th backward has filled it (its cooldown).
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.start_grad_sync_after(len(micro_batches))
        elif self.data_group is not None and not pipe.fsdp:  # FSDP stages reduce-scatter their own (fsdp.py)
            if pipe.grad_sync is None:
                pipe.grad_sync = GradAllReduce([p for p in self.params if id(p) not in pipe.skip_sync],
                                               self.data_group, pipe.bucket_elems)
            pipe.grad_sync.start_after(len(micro_batches))
        args = (inputs,) if pipe.has_first else ()
        with autocast_for(cfg.precision, device):  # bf16 matmuls as in the one-stage step
            pipe.schedule.step(*args, target=targets if pipe.has_last else None)
        if trace is not None:
            trace.window = (t0, time.perf_counter())
        if moes:
            for h in hooks:
                h.remove()
        # The schedule's first step also runs the loss once to infer shapes: keep the micro-batches' own.
        return (torch.stack(pipe.sums[-len(micro_batches):]).sum(dim=0) if pipe.sums
                else torch.zeros(2, device=device))  # ce, z (no aux loss under pp)

    def clip(self, max_norm: float) -> torch.Tensor:
        if self.pipe.grad_sync is not None:
            self.pipe.grad_sync.finish()
        return self.model.grad_norm_plan.clip(self.params, max_norm)  # the norm over every stage's gradients

    def share_loss(self, sums: torch.Tensor) -> torch.Tensor:
        # The spike guard decides on the global loss: every pp rank must agree on skipping.
        return self.pipe.global_sums(sums)

    def reduce_metrics(self, sums: torch.Tensor, loads: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if loads and self.data_group is not None:  # sums are global already (share_loss)
            packed = torch.cat(loads)
            dist.all_reduce(packed, group=self.data_group)
            loads = list(packed.split([x.numel() for x in loads]))
        return torch.cat([sums, sums.new_zeros(1)]), loads  # aux: none under pp


def _load_hook(loads, dropped, j, n_micro):
    def hook(module, args, output):
        loads[j] += module.tokens_per_expert.float()
        dropped[j] += module.dropped_fraction / n_micro
    return hook
