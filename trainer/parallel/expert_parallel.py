"""Expert parallel: each MoE layer's experts are spread over the ranks of an ep group, which reuses
data-parallel (x cp) ranks (seed: "expert parallelism places different experts on different GPUs ...
tokens are sent to the GPU holding their expert with an all-to-all, and sent back the same way").

A rank routes its own tokens exactly as the single-process MoE does (same priority order, same
capacity and dropping, decided where the tokens live), sends each kept assignment to the rank owning
its expert with one all-to-all of variable splits, runs its local experts, and receives the outputs
back with a second all-to-all; the router weights are applied there, at the combine. Both all-to-alls
are differentiable (the backward is the reverse exchange). Their size follows the routing, unless
`moe.pad_to_capacity` pads every expert to its capacity (GShard, Megatron): then it is fixed, E x
capacity rows per rank, which is what `eightfold estimate` counts exactly.

Gradients: the router, attention and every dense weight are replicated over dp x cp and synced by
data parallel as usual; an expert's weights live on one rank of each ep group, so they are left out
of the data-parallel all-reduce and summed only over the ranks that replicate that expert (the same
position in the other ep groups), see `apply_expert_parallel`. Both groups are dimensions of the one
mesh, cut from its dp x cp ranks (mesh.expert_mesh).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model.moe import MoE
from .mesh import ParallelDims


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def expert_parallel_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward with the experts on other ranks; bound to an MoE by `shard_experts`."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [T, D]
    T, E, k = x.shape[0], self.num_experts, self.top_k
    probs, experts, weights = self.route(x)
    # Routing, priority order and capacity exactly as in MoE.forward (GShard: first choices first).
    expert_of = experts.t().reshape(-1)  # [k*T]
    token_of = torch.arange(T, device=x.device).repeat(k)
    weight_of = weights.t().reshape(-1)
    one_hot = F.one_hot(expert_of, E)
    slot = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1
    cap = self.capacity(T)
    keep = slot < cap if cap is not None else torch.ones_like(slot, dtype=torch.bool)
    if self.pad_to_capacity:  # a fixed-size exchange (config validation made sure there is a capacity)
        out = _padded_dispatch_combine(self, x, expert_of[keep], slot[keep], token_of[keep], weight_of[keep], cap)
    else:
        out = _dispatch_combine(self, x, expert_of[keep], token_of[keep], weight_of[keep])
    if self.shared_expert is not None:
        out = out + self.shared_expert(x)

    self.record_routing(one_hot, keep, probs)
    return out.view(shape)


def _dispatch_combine(self: MoE, x: torch.Tensor, expert_of, token_of, weight_of) -> torch.Tensor:
    """The kept assignments (expert, token, router weight) sent as they fall: the splits follow the
    routing, so the ranks first exchange how many each receives. Returns the combined fp32 output [T, D]."""
    E, group, ep, per_rank = self.num_experts, self.ep_group, self.ep_size, self.num_experts // self.ep_size
    order = torch.argsort(expert_of, stable=True)  # grouped by expert, so by owner rank
    send_expert = expert_of[order]
    send_token, send_weight = token_of[order], weight_of[order]
    counts = torch.bincount(send_expert, minlength=E)  # [E] assignments this rank sends
    # Dispatch: first how many each rank receives per local expert, then the tokens themselves.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [ep(src) * per_rank]
    in_splits = counts.view(ep, per_rank).sum(dim=1).tolist()
    recv_by_src = recv_counts.view(ep, per_rank)
    out_splits = recv_by_src.sum(dim=1).tolist()
    received = _all_to_all(x[send_token], out_splits, in_splits, group)  # [R, D], by source, then expert

    # Regroup by local expert (source-major arrivals -> expert-major), run each expert, undo the regroup.
    local_of = torch.repeat_interleave(torch.arange(per_rank, device=x.device).repeat(ep), recv_by_src.reshape(-1))
    regroup = torch.argsort(local_of, stable=True)
    per_expert = torch.bincount(local_of, minlength=per_rank).tolist()
    outputs, start = [], 0
    for j, n in enumerate(per_expert):
        # Every local expert runs, even on no tokens, so its weights always get a gradient (zeros).
        outputs.append(self.experts[str(self.first_expert + j)](received[regroup[start : start + n]]))
        start += n
    y = torch.empty_like(received) if not outputs else torch.cat(outputs)
    y = y[torch.argsort(regroup)]

    # Combine: back to the sending ranks, router weights applied here (seed: scores applied at combine).
    back = _all_to_all(y, in_splits, out_splits, group)  # [kept, D] in send order
    out = torch.zeros_like(x, dtype=torch.float32)
    out.index_add_(0, send_token, (back * send_weight[:, None].to(back.dtype)).to(out.dtype))
    return out


def _padded_dispatch_combine(self: MoE, x: torch.Tensor, expert_of, slot, token_of, weight_of,
                             cap: int) -> torch.Tensor:
    """Every expert gets exactly `cap` rows from every rank, its kept assignments at their queue slots and
    zeros after (GShard's dispatch tensor; Megatron's pad-expert-input-to-capacity): both all-to-alls
    have a fixed size, E * cap rows of which (ep - 1)/ep leave the rank, whatever the routing, and no
    counts go first. The experts also run on the padding; its outputs are never combined, and a zero
    row gives a SwiGLU expert's weights zero gradient, so the result is the unpadded one exactly."""
    E, D = self.num_experts, x.shape[-1]
    group, ep, per_rank = self.ep_group, self.ep_size, self.num_experts // self.ep_size
    at = expert_of * cap + slot  # [kept] row of each assignment in the [E * cap] buffer (experts in rank order)
    send = x.new_zeros(E * cap, D).index_copy(0, at, x[token_of])
    even = [per_rank * cap] * ep
    received = _all_to_all(send, even, even, group).view(ep, per_rank, cap, D)  # source, local expert, slot
    y = torch.stack([self.experts[str(self.first_expert + j)](received[:, j].reshape(ep * cap, D)).view(ep, cap, D)
                     for j in range(per_rank)], dim=1)
    back = _all_to_all(y.reshape(E * cap, D), even, even, group)  # [E * cap, D] in the send buffer's order
    out = torch.zeros_like(x, dtype=torch.float32)
    out.index_add_(0, token_of, (back[at] * weight_of[:, None].to(back.dtype)).to(out.dtype))
    return out


def shard_experts(moe: MoE, group, replica_group, data_size: int) -> None:
    """Keep only this rank's experts (names stay `experts.{global id}`) and route through all-to-all.

    Gradient scale: the loop multiplies every loss by the data-parallel size so that DDP's average
    becomes a sum; expert weights bypass DDP, so their gradient is divided by that size here, and
    summed over `replica_group` (ranks holding the same experts, if any) as it is produced."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    if moe.num_experts % ep:
        raise ValueError(f"num_experts={moe.num_experts} is not divisible by ep={ep}")
    per_rank = moe.num_experts // ep
    first = rank * per_rank
    moe.experts = nn.ModuleDict({str(e): moe.experts[e] for e in range(first, first + per_rank)})
    moe.ep_group, moe.ep_size, moe.first_expert = group, ep, first
    moe.forward = types.MethodType(expert_parallel_forward, moe)

    def sync(grad: torch.Tensor) -> torch.Tensor:
        grad = grad / data_size
        if replica_group is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=replica_group)
        return grad

    moe.expert_grad_sync = sync  # registered on the parameters once they hold memory: register_expert_grad_sync


def register_expert_grad_sync(model: nn.Module) -> None:
    """Hook every local expert weight's gradient (see `shard_experts`). Called after the model is
    materialised: a tensor hook lives on the tensor, and `to_empty` swaps the meta tensor out."""
    for m in model.modules():
        sync = getattr(m, "expert_grad_sync", None)
        if sync is not None:
            for p in m.experts.parameters():
                p.register_hook(sync)


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, data_group) -> list[str]:
    """Shard every MoE layer's experts over the mesh's ep ranks (mesh.expert_mesh); returns the names of
    the expert parameters, which data parallel must leave alone. Their gradient hooks come later
    (register_expert_grad_sync)."""
    ep = dims.ep
    if data_group is None or dist.get_world_size(data_group) % ep:
        raise ValueError(f"parallel.ep={ep} must divide the data-parallel x cp ranks "
                         f"({0 if data_group is None else dist.get_world_size(data_group)})")
    group, replicas = dims.group("ep"), dims.group("ep_replica")
    data_size = dist.get_world_size(data_group)
    names = []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            shard_experts(m, group, replicas, data_size)
            names += [f"{name}.experts.{n}" for n, _ in m.experts.named_parameters()]
    if not names:
        raise ValueError(f"parallel.ep={ep} but the model has no MoE layer")
    from .grad_norm import GradNormPlan

    params = dict(model.named_parameters())
    model.grad_norm_plan = GradNormPlan({id(params[n]) for n in names}, shard_group=group)
    return names
