"""Data-parallel gradient averaging for pipeline stages at zero=0 (DDP cannot wrap a stage the schedule
drives): the stage's gradients in flat buckets, one all-reduce per bucket, each launched as soon as the
stage's last micro-batch backward has filled it (grad_ready.py), so the reduction runs during the
schedule's cooldown instead of after it. `finish()` launches what no hook did, waits, and writes the
mean back into the gradients. The same buckets, cut the same way, reduce the same whether a hook or
`finish()` launched them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .grad_ready import GradReadiness


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a tensor-parallel DTensor: replicas hold the same shard


class GradAllReduce:
    def __init__(self, params: list[torch.nn.Parameter], group, bucket_elems: int):
        self.group = group
        self.size = dist.get_world_size(group)
        self.buckets: list[list[torch.nn.Parameter]] = []
        current, n = [], 0
        for p in params:  # the loop's order: buckets close once they hold bucket_elems
            current.append(p)
            n += _local(p).numel()
            if n >= bucket_elems:
                self.buckets.append(current)
                current, n = [], 0
        if current:
            self.buckets.append(current)
        self.in_flight: dict[int, tuple] = {}  # bucket -> (work, flat buffer, the gradients it holds)
        self.readiness = GradReadiness(self.buckets, self.start)

    def start_after(self, backwards: int) -> None:
        """The next `backwards` backward passes (a stage's m micro-batches) finish the gradients."""
        self.readiness.arm(backwards)

    def start(self, i: int) -> None:
        grads = [_local(p.grad) for p in self.buckets[i] if p.grad is not None]
        if not grads:
            self.in_flight[i] = (None, None, [])
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.in_flight[i] = (dist.all_reduce(flat, group=self.group, async_op=True), flat, grads)

    def finish(self) -> None:
        for i in range(len(self.buckets)):
            if i not in self.in_flight:
                self.start(i)
        for i in range(len(self.buckets)):
            work, flat, grads = self.in_flight.pop(i)
            if work is None:
                continue
            work.wait()
            flat /= self.size
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        self.readiness.reset()
