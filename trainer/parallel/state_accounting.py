"""Counting model state: the bytes one rank holds in weights, gradients and optimizer state, by walking
the tensors themselves (seed: "2 (bf16 weight) + 2 (bf16 gradient) + 4 + 4 + 4 = 16 bytes per parameter",
sharded as ZeRO dictates). The measured side of `eightfold estimate`'s state bytes per rank.

Counted, each tensor's bytes on this rank (a DTensor's local shard), a storage shared by views once:
- weights: the model's parameters (FSDP2's fp32 shards; under TP this rank's slice);
- grads: their `.grad` (DDP's are views into its buckets, so the buckets are these bytes), and the fp32
  `main_grad` ZeRO-1 accumulates into under fp32_grad_accum (Megatron's; the seed's 18 bytes);
- masters: the optimizer's fp32 copies of low-precision parameters (MasterWeights' dict, ZeRO-1's
  owned segments); none when the parameters are fp32 (they are their own masters, ZeRO-1's views of them);
- moments: the optimizer state's tensors (Adam's m and v, SGD's momentum; not the 0-d step counters).
Named apart, not in the total: ZeRO-1's gradient shards (its reduce-scatter's output, in fp32 as the
masters' `.grad` until zero_grad: a transient bucket, 4/d bytes per parameter), the module buffers (RoPE
tables, routing biases) and any other `.grad` an optimizer hangs on its masters.

Measure between a step's update and its zero_grad (`measure_at_zero_grad`): the gradients are still
there, the masters and moments exist (they are made lazily at the first step).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from .zero1 import DistributedOptimizer, local

STATE = ("weights", "grads", "masters", "moments")


class _Storages:
    """Byte ranges already counted, per storage: a view of something counted adds nothing."""

    def __init__(self):
        self.seen: dict[int, list[tuple[int, int]]] = defaultdict(list)

    def add(self, t: torch.Tensor) -> int:
        t = local(t)
        if t.numel() == 0:
            return 0
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + t.numel() * size  # a contiguous view's extent (every tensor walked here is one)
        key = t.untyped_storage().data_ptr()
        new = hi - lo
        for a, b in self.seen[key]:
            new -= max(0, min(b, hi) - max(a, lo))
        self.seen[key].append((lo, hi))
        return max(new, 0)


def _masters_and_moments(optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(masters, moments, the masters' .grad) of a torch optimizer, MasterWeights or ZeRO-1."""
    if isinstance(optimizer, DistributedOptimizer):
        segments = list(optimizer._all_segments())
        masters = [s.master for s in segments]
        inner = optimizer.inner
    else:
        masters = list(getattr(optimizer, "masters", {}).values())
        inner = optimizer
    moments = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    master_grads = [m.grad for m in masters if m.grad is not None]
    return masters, moments, master_grads


def rank_state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """{weights, grads, masters, moments, state (their sum), zero1_grad_shards, master_grads, buffers}
    in bytes on this rank; see the module docstring for what each holds."""
    seen = _Storages()
    params = [p for p in model.parameters()]
    out = {"weights": sum(seen.add(p.detach()) for p in params),
           "grads": sum(seen.add(g) for p in params for g in (p.grad, getattr(p, "main_grad", None))
                        if g is not None)}
    masters, moments, master_grads = _masters_and_moments(optimizer)
    out["masters"] = sum(seen.add(m) for m in masters)
    out["moments"] = sum(seen.add(m) for m in moments)
    out["state"] = sum(out[k] for k in STATE)
    named = sum(seen.add(g) for g in master_grads)
    zero1 = isinstance(optimizer, DistributedOptimizer)
    out["zero1_grad_shards"] = named if zero1 else 0
    out["master_grads"] = 0 if zero1 else named
    out["buffers"] = sum(seen.add(b) for b in model.buffers())
    return out


def measure_at_zero_grad(optimizer, sink: dict, model: nn.Module) -> None:
    """Make the optimizer's next zero_grad first record rank_state_bytes(model, optimizer) into `sink`
    (the moment after the update, before the gradients go), then do what it did."""
    original = optimizer.zero_grad

    def zero_grad(*args, **kwargs):
        sink.update(rank_state_bytes(model, optimizer))
        optimizer.zero_grad = original  # once
        return original(*args, **kwargs)

    optimizer.zero_grad = zero_grad
