"""Whole weights out of a parallelised model: what post-training hands its rollout engine (and saves). Under
FSDP and tensor parallel the parameters are DTensors holding this rank's shard; here each becomes the full
tensor, a plain copy on the CPU under the trainer's names. Collective: every rank of the model's mesh calls
these, in the same order (each sharded tensor is one all-gather), and every rank gets the whole weights.

Weights are read through `state_dict()`: under ZeRO-1 its pre-hook waits for the step's overlapped
parameter all-gather (param_ready.py), which reading `.parameters()` right after the step would race."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..lora import lora_modules, merged_state_dict
from .ddp import unwrap


def gathered(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor whole (a DTensor's shards all-gathered) as a detached copy on the CPU."""
    out = {}
    for name, t in tensors.items():
        whole = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        out[name] = whole.clone() if whole.device.type == "cpu" else whole.to("cpu")
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of the model, LoRA adapters folded in (lora.merged_state_dict)."""
    return gathered(merged_state_dict(unwrap(model)))


def trained_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only what an optimizer step changes: the trainable parameters, or with LoRA the adapted layers'
    merged weights W + (alpha / r) B A."""
    inner = unwrap(model)
    state = inner.state_dict()  # first: ZeRO-1's all-gather is waited for here (see the module docstring)
    loras = lora_modules(inner)
    if loras:
        picked = {f"{name}.weight": state[f"{name}.weight"] + m.delta_weight().to(m.weight.dtype)
                  for name, m in loras.items()}
    else:
        picked = {name: state[name] for name, p in inner.named_parameters() if p.requires_grad}
    return gathered(picked)
