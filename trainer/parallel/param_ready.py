"""Where the next forward waits for gathered weights (Megatron's overlap_param_gather).

ZeRO-1's step launches every bucket's all-gather and returns; the next forward waits for a bucket only
where it first needs it: in a forward pre-hook of the first unit (the embedding, one block, the final
norm) holding one of the bucket's parameters. So the first block computes while the later buckets
are still on the wire. The LM head is waited for by the unit before it (the final norm): the fused loss
reads `lm_head.weight` without calling the head (trainer/loss.py HeadLoss), and a hook on the head
would turn that fusion off. Anything reading the weights outside a forward goes through
`state_dict()` / `load_state_dict()` (checkpoints, tests), whose pre-hooks wait for every bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

HEADS = ("lm_head",)  # read by the loss without their forward (trainer/loss.py HeadLoss)


def owners(model: nn.Module) -> dict[int, nn.Module]:
    """parameter id -> the unit whose forward pre-hook waits for it (the first unit holding it)."""
    owner: dict[int, nn.Module] = {}
    previous = None
    for name, child in model.named_children():
        if name in HEADS and previous is not None:
            for p in child.parameters():
                owner.setdefault(id(p), previous)
            continue
        parts = (list(child.values()) if isinstance(child, nn.ModuleDict)
                 else list(child) if isinstance(child, nn.ModuleList) else [child])
        for unit in parts:
            for p in unit.parameters():
                owner.setdefault(id(p), unit)
            previous = unit
    for p in model.parameters(recurse=False):
        owner.setdefault(id(p), model)
    return owner


def register_param_waits(model: nn.Module, buckets: Sequence[Sequence[torch.Tensor]],
                         wait: Callable[[list[int]], None], wait_all: Callable[[], None]) -> list:
    """Forward pre-hooks that call `wait(bucket indices)` for the buckets each unit uses, and
    state_dict / load_state_dict pre-hooks that call `wait_all()`. Returns the hook handles."""
    owner = owners(model)
    uses: dict[int, tuple[nn.Module, list[int]]] = {}
    for i, params in enumerate(buckets):
        for p in params:
            unit = owner.get(id(p), model)
            entry = uses.setdefault(id(unit), (unit, []))
            if i not in entry[1]:
                entry[1].append(i)
    handles = []
    for unit, indices in uses.values():
        handles.append(unit.register_forward_pre_hook(_waiter(wait, sorted(indices))))
    handles.append(model.register_state_dict_pre_hook(lambda *args: wait_all()))
    handles.append(model.register_load_state_dict_pre_hook(lambda *args: wait_all()))
    return handles


def _waiter(wait: Callable[[list[int]], None], indices: list[int]):
    @torch.compiler.disable  # a c10d wait and copies: not something for a compiled block's graph
    def hook(module, args):
        wait(indices)

    return hook
