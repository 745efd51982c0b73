"""Parallelism applied to the model from outside, one file per technique (TorchTitan's discipline):
`mesh.py` builds the one DeviceMesh every process group comes from; `ddp.py` replicates the model
with bucketed, overlapped gradient all-reduce; `activation_checkpoint.py` and `compile.py` wrap
blocks in place; `tensor_parallel.py` (+ `vocab_parallel.py`) applies DTensor TP/SP plans,
`fsdp.py` ZeRO-2/3 and HSDP, `zero1.py` the distributed optimizer, `comm_accounting.py` counts
collectives per mesh dimension, `materialize.py` allocates and initialises each rank's share of a
model built on the meta device. `parallelize()` composes them in a fixed order without touching the
model."""

from __future__ import annotations

import torch
from torch import nn

from infra.config.parallel import ParallelConfig
from infra.config.train import TrainConfig

from ..precision import LOW_PRECISION, cast_parameters, convert_to_fp8
from .activation_checkpoint import apply_activation_checkpointing
from .compile import apply_compile
from .context_parallel import apply_context_parallel
from .ddp import apply_ddp
from .expert_parallel import apply_expert_parallel, register_expert_grad_sync
from .fsdp import apply_fsdp
from .layouts import check_holder_supported, check_supported
from .materialize import materialize, on_meta
from .mesh import ParallelDims, build_parallel_dims, data_context_group
from .model_parts import transformers_of
from .pipeline import apply_pipeline
from .tensor_parallel import apply_tensor_parallel, keep_grads_in_param_layout

__all__ = ["ParallelDims", "build_parallel_dims", "parallelize"]


def parallelize(model: nn.Module, dims: ParallelDims, parallel: ParallelConfig, train: TrainConfig, *,
                device: torch.device | None = None, seed: int | None = None) -> nn.Module:
    """Apply, in this order: float8 linear layers (precision fp8), tensor parallel (+ sequence, vocab
    parallel), activation checkpointing, torch.compile per block, expert parallel, the pipeline cut,
    context parallel, FSDP2 for ZeRO-2/3 and HSDP (in place); then, for a model built on the meta device
    (trainer.meta_init.build_model), this rank's share is allocated on `device` and initialised from
    `seed` with the whole model's values (materialize.py); then DDP for zero=0 (it broadcasts real
    weights). ZeRO-1 is the optimizer (zero1.build_parallel_optimizer). A model already on a device
    (post-training's loaded base) is parallelised as it is. `model` is a Transformer, or a module holding
    Transformers (a reward model: each Transformer is planned as one, heads are replicated; model_parts.py).
    Returns the module to train (the DDP wrapper, or `model` itself)."""
    trunks = transformers_of(model)  # the model, or the Transformers it holds (model_parts.py)
    for cfg in [t.cfg for t in trunks] or [getattr(model, "cfg", None)]:
        check_supported(parallel, cfg)
    check_holder_supported(parallel, model)
    meta = on_meta(model)
    if meta and (device is None or seed is None):
        raise ValueError("parallelize: a model on the meta device needs the device and seed to materialise it on")
    fsdp = parallel.zero >= 2 and dims.dp_shard > 1
    if train.precision in LOW_PRECISION and not fsdp:  # FSDP2 keeps fp32 shards as masters, gathers bf16 (fsdp.py)
        cast_parameters(model, torch.bfloat16)  # bf16 weights; fp32 masters in the optimizer (trainer/precision.py)
    if train.precision == "fp8":  # before compile and the wrappers, as TorchTitan converts (precision.py)
        convert_to_fp8(model, train.fp8, device or next(model.parameters()).device)
    if parallel.tp > 1:  # tensor (+ sequence, vocab) parallel: tensor_parallel.py
        apply_tensor_parallel(model, dims, parallel.sequence_parallel)
    apply_activation_checkpointing(model, train.activation_checkpointing)
    if train.compile:
        apply_compile(model)
    # Pipeline, context and expert parallel (pipeline.py, context_parallel.py, expert_parallel.py).
    data_group = data_context_group(dims)  # dp x cp: same weights, different tokens
    experts = apply_expert_parallel(model, dims, data_group) if parallel.ep > 1 else []
    if parallel.pp > 1:
        micro = train.global_batch_size // (train.micro_batch_size * dims.dp)
        model = apply_pipeline(model, dims, parallel, train, data_group, micro, device=device)
        model.pipeline.skip_sync = {id(p) for n, p in model.named_parameters() if n in set(experts)}
    if parallel.cp > 1:
        parts = model.pipeline.parts if parallel.pp > 1 else [model]
        apply_context_parallel(model, dims.group("cp"), parallel.cp_impl, hook_targets=parts)
    if fsdp:  # ZeRO-2/3 and HSDP: fsdp.py (ZeRO-1 is the optimizer: zero1.py)
        model = apply_fsdp(model, dims, parallel.zero, train.precision, reduce_fp32=train.fp32_grad_accum)
    if meta:  # only now does this rank allocate: its share, nothing else (materialize.py)
        materialize(model, device, seed, roots=model.pipeline.parts if parallel.pp > 1 else None)
    if experts:
        register_expert_grad_sync(model)
    if parallel.tp > 1:  # gradient hooks go on the materialised parameters (tensor_parallel.py)
        keep_grads_in_param_layout(model)
    if not fsdp and parallel.pp == 1 and data_group is not None and parallel.zero == 0:
        model = apply_ddp(model, dims, bucket_mb=parallel.bucket_mb, group=data_group, ignore=experts)
    return model
