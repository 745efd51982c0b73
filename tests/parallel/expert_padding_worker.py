"""Worker of test_expert_padding.py (torchrun, 2 ranks, gloo): one MoE layer with its experts over ep=2,
dispatched with and without padding to capacity, against the whole layer on the same tokens. Writes
rank 0's findings as JSON to argv[1]."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from infra.config.model import MoEConfig
from trainer.model.moe import MoE
from trainer.parallel.comm_accounting import CommCounter
from trainer.parallel.expert_parallel import shard_experts

DIM, HIDDEN, E, K, T = 16, 24, 4, 2, 40


def whole_layer(pad: bool, factor: float) -> MoE:
    torch.manual_seed(0)
    m = MoE(DIM, HIDDEN, MoEConfig(num_experts=E, top_k=K, capacity_factor=factor, pad_to_capacity=pad))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    found = {}
    for pad in (True, False):
        for factor in (0.75, 2.0):  # overflow dropped; every assignment kept
            ref = whole_layer(pad, factor)
            ep = copy.deepcopy(ref)
            shard_experts(ep, group, None, data_size=1)
            x = torch.randn(T, DIM, generator=torch.Generator().manual_seed(100 + rank))
            # The whole layer on this rank's tokens: the output and input gradient expert parallel must give;
            # its expert gradients summed over the ranks are what each expert's owner must hold.
            x_ref = x.clone().requires_grad_(True)
            y_ref = ref(x_ref)
            (y_ref * torch.linspace(-1, 1, DIM)).sum().backward()
            x_ep = x.clone().requires_grad_(True)
            with CommCounter({group.group_name: "ep"}) as counter:
                y_ep = ep(x_ep)
                (y_ep * torch.linspace(-1, 1, DIM)).sum().backward()
            def rel(a, b):  # max |a - b| over max |b|
                return float((a - b).detach().abs().max() / b.detach().abs().max())

            worst = {"out": rel(y_ep, y_ref), "x_grad": rel(x_ep.grad, x_ref.grad)}
            summed = {}
            for name, p in ref.experts.named_parameters():  # every expert, in the same order on every rank
                summed[name] = p.grad.clone()
                dist.all_reduce(summed[name])
            for name, p in ep.experts.named_parameters():
                worst[f"experts.{name}"] = rel(p.grad, summed[name])
            summary = counter.summary().get("ep", {"bytes": 0.0, "calls": 0})
            kept = float(1 - ep.dropped_fraction)
            found[f"pad={pad} factor={factor}"] = {"max_rel_diff": worst, "ep_bytes": summary["bytes"],
                                                   "ep_calls": summary["calls"], "kept": kept,
                                                   "capacity": ep.capacity(T)}
    all_found = [None] * world
    dist.all_gather_object(all_found, found)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(all_found, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
