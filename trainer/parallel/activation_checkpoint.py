"""Activation checkpointing per transformer block, in place (parameter names do not change).

full:      keep only each block's input; recompute the whole block in backward.
selective: per block, keep the outputs of the matmuls and attention (the expensive ops) and
           recompute the cheap element-wise ones (norms, RoPE, SiLU, residual adds) - TorchTitan's
           op-level selective checkpointing, in the spirit of Korthikanti et al. (2022).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..model.bf16_matmul import bf16_gemm  # noqa: F401  (registers eightfold::bf16_gemm)
from .model_parts import transformers_of

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.eightfold.bf16_gemm.default,  # a bf16 GEMM on a CPU without one: its bf16 output, not an fp32 one
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing={mode!r}; expected none, selective or full")
    for block in (b for trunk in transformers_of(model) for b in trunk.layers.values()):
        inner = block.forward
        kwargs = {"use_reentrant": False}
        if mode == "selective":
            kwargs["context_fn"] = _selective_context
        block.forward = functools.partial(checkpoint, inner, **kwargs)
