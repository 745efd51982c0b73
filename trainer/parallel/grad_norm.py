"""The global gradient norm when a rank holds only part of the parameters (seed: "First the gradient
is clipped" - by the norm of the *whole* model's gradient, or replicas would clip differently).

Squared norms add: a rank sums its own gradients' squares, the parts that are sharded across a group
(expert-parallel experts) are summed over that group, and pipeline stages add theirs over pp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradNormPlan:
    """`sharded`: parameter ids whose squares are summed over `shard_group` (each rank holds different
    ones); `stage_group`: the pp group, over which every rank's total is summed."""

    def __init__(self, sharded: set[int] | None = None, shard_group=None, stage_group=None):
        self.sharded, self.shard_group, self.stage_group = sharded or set(), shard_group, stage_group

    def norm(self, params) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grads_local, grads_sharded = [], []
        for p in params:
            if p.grad is not None:
                (grads_sharded if id(p) in self.sharded else grads_local).append(p.grad)
        device = (grads_local or grads_sharded)[0].device if grads_local or grads_sharded else torch.device("cpu")

        def square_sum(g):  # a tensor-parallel DTensor gradient: its sum over the whole tensor (tp collective)
            s = g.detach().float().pow(2).sum()
            return s.full_tensor() if hasattr(s, "full_tensor") else s

        def sq(gs):
            return torch.stack([square_sum(g) for g in gs]).sum() if gs else torch.zeros((), device=device)

        shard_sq = sq(grads_sharded)
        if self.shard_group is not None:
            dist.all_reduce(shard_sq, group=self.shard_group)
        total = sq(grads_local) + shard_sq
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        return total.sqrt(), grads_local + grads_sharded

    def clip(self, params, max_norm: float) -> torch.Tensor:
        """Measure the global norm and scale every gradient down to `max_norm` when above it (0: measure only)."""
        norm, grads = self.norm(params)
        if max_norm > 0:
            coef = float((max_norm / (norm + 1e-6)).clamp(max=1.0))  # torch's clip_grad_norm_ rule
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return norm
