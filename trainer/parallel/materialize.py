"""Materialisation: the model is built on the meta device (shapes only, no memory) and parallelised
there (tensor parallel's DTensors, the pipeline cut, expert parallel's split, FSDP2's shards); then each
rank allocates only what it holds, on its own device, and fills it with the values one process would
hold at those positions (trainer/model/init.py), so every layout starts from the same weights.

This is TorchTitan's recipe (meta model, parallelise, `to_empty`, `init_weights`) with an initialisation
that is exact per shard by construction: values are a function of (seed, parameter name, position),
drawn on the CPU block by block, rather than of a device RNG's stream and offsets (DTensor's RNG
tracker), which would tie the weights to the device type and to how the tensor is split.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


@contextlib.contextmanager
def swap_tensors_on_conversion():
    """`nn.Module._apply` (so `to_empty`) swaps the new tensor into each existing Parameter object
    instead of registering a new Parameter (a meta tensor cannot take a real one through `.data`): the
    plans applied on meta keep pointing at the parameters the model trains (gradient-norm plans and the
    pipeline hold them by id, FSDP2 by object)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def local_shard(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(the tensor holding this rank's values of `p`, their offset in the whole `p`). A DTensor's shard
    is a box of the global tensor: under tensor parallel a column or row block, under FSDP2 a block of
    rows (of the tensor-parallel block, on a 2-D mesh: torch's _StridedShard)."""
    if not isinstance(p, DTensor):
        return p, None
    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"a parameter {tuple(p.shape)} with placements {p.placements}: local shard "
                           f"{tuple(local.shape)} is not the box {tuple(shape)} at {tuple(offset)}")
    return local, tuple(offset)


def materialize(model: nn.Module, device: torch.device, seed: int, roots: list[nn.Module] | None = None) -> nn.Module:
    """Allocate this rank's parameters and buffers on `device` (uninitialised) and initialise them:
    `model.init_weights(seed, shard=local_shard)`. `roots` are the modules to allocate through (default
    the model): under pipeline parallel the stage modules, which are FSDP2's roots when it shards, so
    each re-points its padded shards at the new storage (FSDPModule._apply)."""
    with swap_tensors_on_conversion():
        for root in roots or [model]:
            root.to_empty(device=device)
    if on_meta(model):
        raise RuntimeError("materialize: tensors left on the meta device outside the given roots")
    model.init_weights(seed, shard=local_shard)
    return model
