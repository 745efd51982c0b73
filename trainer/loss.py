"""Losses, kept outside the model: token-weighted cross-entropy with z-loss, and the MoE auxiliary
losses collected from the model's MoE layers after a forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .linear_cross_entropy import linear_cross_entropy_sum
from .model.bf16_matmul import Linear
from .model.moe import MoE

IGNORE_INDEX = -100


@dataclass
class TokenLoss:
    """Sums over the non-ignored target tokens of one micro-batch; the loop divides by the step's
    token count over all micro-batches and ranks, so every token weighs the same (seed: "Gradients from
    its 4 micro-batches add into the same buffer")."""

    ce_sum: torch.Tensor
    z_sum: torch.Tensor
    tokens: torch.Tensor  # int64 scalar
    # multi-token prediction: the weighted MTP loss added to the total, and per depth k the summed
    # cross-entropy and target count, [2, D] (logged as mtp_loss_k; model/mtp.py)
    mtp_total: torch.Tensor | None = None
    mtp_sums: torch.Tensor | None = None

    @property
    def total(self) -> torch.Tensor:
        total = self.ce_sum + self.z_sum
        return total if self.mtp_total is None else total + self.mtp_total


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, ignore_index: int = IGNORE_INDEX
) -> TokenLoss:
    """logits [B, S, V] (any float dtype; computed in fp32), targets [B, S] -> summed losses.

    z-loss (PaLM): z_loss * log(Z)^2 per token, pulling the softmax normaliser towards 1 so logits
    cannot drift (seed: a stabiliser against loss spikes).

    Logits that are a DTensor split over the vocabulary (tensor parallel) go to the vocab-parallel
    version, so the full logits are never gathered."""
    if getattr(logits, "placements", None) is not None:
        from .parallel import vocab_parallel

        if vocab_parallel.is_vocab_sharded(logits):
            return vocab_parallel.cross_entropy_sum(logits, targets, z_loss, ignore_index)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    target = targets.reshape(-1)
    ce_sum = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
    mask = target != ignore_index
    if z_loss > 0:
        log_z = torch.logsumexp(flat, dim=-1)
        z_sum = z_loss * (log_z.square() * mask).sum()
    else:
        z_sum = torch.zeros((), device=logits.device)
    return TokenLoss(ce_sum=ce_sum, z_sum=z_sum, tokens=mask.sum())


def target_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position, [B, S] in fp32 (DPO's and GRPO's log-probs). An ignored
    target (negative) reads token 0's: callers mask those positions. Logits that are a DTensor split over
    the vocabulary (tensor parallel) go to the vocab-parallel version, as in `cross_entropy_sum`."""
    if getattr(logits, "placements", None) is not None:
        from .parallel import vocab_parallel

        if vocab_parallel.is_vocab_sharded(logits):
            return vocab_parallel.target_logps(logits, targets)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)


class HeadLoss:
    """The LM head and the token loss as one step, passed to the model as `model(tokens, head=...)`.

    When the head is a plain linear layer on ordinary tensors, the fused kernel runs
    (trainer/linear_cross_entropy.py: chunked, no fp32 logits, same sums); otherwise (tensor-parallel
    DTensor weights, a wrapped or hooked head) the logits are computed by the head module itself and
    go through `cross_entropy_sum`, vocab-parallel included."""

    def __init__(self, targets: torch.Tensor, z_loss: float = 0.0, ignore_index: int = IGNORE_INDEX):
        self.targets, self.z_loss, self.ignore_index = targets, z_loss, ignore_index

    def __call__(self, hidden: torch.Tensor, lm_head: nn.Module) -> TokenLoss:
        if can_fuse_head(lm_head, hidden):
            ce_sum, z_sum, tokens = linear_cross_entropy_sum(hidden, lm_head.weight, self.targets, self.z_loss,
                                                             self.ignore_index)
            return TokenLoss(ce_sum=ce_sum, z_sum=z_sum, tokens=tokens)
        return cross_entropy_sum(lm_head(hidden), self.targets, self.z_loss, self.ignore_index)


def can_fuse_head(lm_head: nn.Module, hidden: torch.Tensor) -> bool:
    """A bias-free linear layer (torch's or the model's own) with no hooks, on plain (not DTensor) weight and input."""
    return (type(lm_head) in (nn.Linear, Linear) and lm_head.bias is None
            and not lm_head._forward_hooks and not lm_head._forward_pre_hooks
            and not hasattr(lm_head.weight, "placements") and not hasattr(hidden, "placements"))


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum over MoE layers of aux_loss_coef * aux_loss from the last forward (None when there is none)."""
    terms = [m.aux_loss_coef * m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(terms).sum() if terms else None
