"""The optimizer and the learning-rate schedule (seed: "First the gradient is clipped ... Then AdamW
updates each weight"; "linear warm-up ..., then cosine decay to about a tenth of the peak").

Weight decay applies to matrices only: norm weights (and biases, which this model has none of) are
excluded, as in GPT-2/Megatron, because shrinking a gain towards zero is not regularisation. The
embedding is decayed like any matrix (Megatron's default; it is also the LM head when tied).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from infra.config.train import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW or plain SGD (for parity tests). fp32 parameters are their own masters; bf16 ones get fp32
    masters in the optimizer (trainer.precision.MasterWeights), so the moments are fp32 either way.

    The fused AdamW kernel is used where torch has one for the device (CUDA, and CPU in recent torch);
    otherwise the multi-tensor (`foreach`) path."""
    from .precision import MasterAdamW, MasterSGD

    groups = param_groups(model, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    masters = any(p.dtype != torch.float32 for p in params)
    if cfg.optimizer == "sgd":
        return (MasterSGD if masters else torch.optim.SGD)(groups, lr=cfg.lr)
    adamw = MasterAdamW if masters else torch.optim.AdamW
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)  # the kernel sees fp32 masters
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return adamw(groups, fused=fused, **kwargs)
    except (RuntimeError, TypeError):  # a torch without a fused kernel for this device
        return adamw(groups, foreach=True, **kwargs)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based).

    warmup: linear from lr/warmup to lr over `warmup_steps`; then
    cosine: lr_min + (lr - lr_min) * (1 + cos(pi * progress)) / 2, lr_min = min_lr_ratio * lr;
    wsd:    flat at lr, then linear to lr_min over the last `decay_fraction` of the steps;
    constant: flat at lr."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # warmup-stable-decay
    decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
    decay_start = max(cfg.warmup_steps, cfg.steps - decay_steps)
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, cfg.steps - decay_start))
    return peak + (floor - peak) * progress


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients, measured before clipping; scales them down to `max_norm` when
    above it (0 disables clipping but still measures)."""
    params = [p for p in params if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    if any(hasattr(p.grad, "placements") for p in params):
        # DTensor gradients (tensor parallel, FSDP): the norm of sharded pieces is a partial result
        # until reduced, so take the full value first, then scale (TorchTitan's clip_grad_norm_).
        # Bring each gradient to its parameter's layout once, here, rather than in every later use: a
        # replicated weight used on sharded inputs (norm gains under sequence parallel) gets a Partial
        # gradient (an all-reduce), the row-split embedding a replicated one (a local slice).
        for p in params:
            if tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, limit, norm, foreach=True)
        return norm
    return torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
