"""Parallelism applied to the model from outside, one file per technique (TorchTitan's discipline):
`mesh.py` builds the one DeviceMesh every process group comes from; `ddp.py` replicates the model
with bucketed, overlapped gradient all-reduce; `activation_checkpoint.py` and `compile.py` wrap
blocks in place. `parallelize()` composes them in a fixed order; later layouts (TP, FSDP, PP) slot
into that order without touching the model."""

from __future__ import annotations

from torch import nn

from infra.config.parallel import ParallelConfig
from infra.config.train import TrainConfig

from .activation_checkpoint import apply_activation_checkpointing
from .compile import apply_compile
from .ddp import apply_ddp
from .mesh import ParallelDims, build_parallel_dims

__all__ = ["ParallelDims", "build_parallel_dims", "parallelize"]


def parallelize(model: nn.Module, dims: ParallelDims, parallel: ParallelConfig, train: TrainConfig) -> nn.Module:
    """Apply, in this order: tensor parallel (issue: TP), activation checkpointing, torch.compile per
    block, then data parallel (DDP here; ZeRO/FSDP later). Returns the module to train (the DDP
    wrapper, or `model` itself on one data-parallel rank)."""
    if parallel.tp > 1 or parallel.pp > 1 or parallel.cp > 1 or parallel.ep > 1 or parallel.zero > 0:
        raise NotImplementedError(
            f"parallel layout tp={parallel.tp} pp={parallel.pp} cp={parallel.cp} ep={parallel.ep} "
            f"zero={parallel.zero} is not available yet in this trainer (only dp with zero=0)"
        )
    apply_activation_checkpointing(model, train.activation_checkpointing)
    if train.compile:
        apply_compile(model)
    if dims.dp > 1:
        model = apply_ddp(model, dims, bucket_mb=parallel.bucket_mb)
    return model
