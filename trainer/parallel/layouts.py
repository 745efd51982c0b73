"""Which combinations of the parallel techniques this trainer composes, refused with the reason
before any group is built. The rules live in `infra.config.parallel.unsupported_layout` so config
validation (`eightfold config show`) refuses the same layouts before anything starts; the trainer
checks again at start, for a config that did not come through validation."""

from __future__ import annotations

from torch import nn

from infra.config.model import ModelConfig
from infra.config.parallel import ParallelConfig, unsupported_layout


def check_supported(parallel: ParallelConfig, model: ModelConfig | None = None) -> None:
    reason = unsupported_layout(parallel, model)
    if reason:
        raise NotImplementedError(reason)


def check_holder_supported(parallel: ParallelConfig, model: nn.Module) -> None:
    """A module that holds Transformers rather than being one (a reward model, PPO's policy and value): data
    parallel (DDP, ZeRO-1, FSDP) and tensor parallel apply to it; pipeline, context and sequence parallel are
    refused."""
    from ..model import Transformer

    if isinstance(model, Transformer):
        return
    name = type(model).__name__
    if parallel.pp > 1:
        raise NotImplementedError(
            f"parallel.pp={parallel.pp} with a {name}: the pipeline cuts one Transformer's layers into stages, and "
            f"a {name} holds its Transformers under a forward of its own; use pp=1 (data or tensor parallel)")
    if parallel.cp > 1 or (parallel.tp > 1 and parallel.sequence_parallel):
        how = f"parallel.cp={parallel.cp}" if parallel.cp > 1 else f"parallel.tp={parallel.tp} with sequence_parallel"
        raise NotImplementedError(
            f"{how} with a {name}: each sequence is split over the ranks, and a {name}'s forward reads hidden states "
            "at positions of the whole sequence (a head on the trunk); use cp=1 and sequence_parallel=false")
