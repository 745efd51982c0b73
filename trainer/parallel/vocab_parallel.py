"""Vocab-parallel cross-entropy (Megatron-LM): each tensor-parallel rank holds logits for V/t of the
vocabulary and the full [b, s, V] logits never exist on one rank.

Forward, with three all-reduces of [b*s] values over tp:
  m      = max over the vocabulary          (all-reduce MAX; for stability)
  z      = sum exp(logit - m)               (all-reduce SUM)
  target = the target's logit - m           (all-reduce SUM; only its owner contributes)
  ce = log z - target,  log Z = log z + m   (for the z-loss)
Backward needs no communication: d ce / d logit = softmax - onehot(target) on the rank's own slice,
and d logZ / d logit = softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..loss import IGNORE_INDEX, TokenLoss


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        # logits [N, V_local] fp32, targets [N] (ignore_index allowed)
        with torch.no_grad():
            m = logits.max(dim=-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            shifted = logits - m[:, None]
            v_local = logits.shape[-1]
            local_t = targets - vocab_start
            mine = (local_t >= 0) & (local_t < v_local)
            idx = local_t.clamp(0, v_local - 1)
            target_logit = shifted.gather(1, idx[:, None]).squeeze(1) * mine
            dist.all_reduce(target_logit, group=group)
            exp = shifted.exp()
            z = exp.sum(dim=-1)
            dist.all_reduce(z, group=group)
            log_z = z.log()
        ctx.save_for_backward(exp / z[:, None], idx, mine)
        return log_z - target_logit, log_z + m

    @staticmethod
    def backward(ctx, grad_ce, grad_log_z):
        softmax, idx, mine = ctx.saved_tensors
        grad = softmax * (grad_ce + grad_log_z)[:, None]
        grad.scatter_add_(1, idx[:, None], (-grad_ce * mine)[:, None])
        return grad, None, None, None


def is_vocab_sharded(logits) -> bool:
    placements = getattr(logits, "placements", None)
    return bool(placements) and len(placements) == 1 and placements[0].is_shard(logits.dim() - 1)


def _local_rows(logits) -> tuple[torch.Tensor, int, object]:
    """(this rank's logits as fp32 rows [N, V/t], the index of its first vocabulary entry, the tp group)."""
    mesh = logits.device_mesh
    rank, t = mesh.get_local_rank(), mesh.size()
    local = logits.to_local()
    v_local = local.shape[-1]
    if v_local * t != logits.shape[-1]:
        raise ValueError(f"vocab {logits.shape[-1]} is not split evenly over tp={t} (local {v_local})")
    return local.reshape(-1, v_local).float(), rank * v_local, mesh.get_group()


def cross_entropy_sum(logits, targets: torch.Tensor, z_loss: float = 0.0,
                      ignore_index: int = IGNORE_INDEX) -> TokenLoss:
    """`trainer.loss.cross_entropy_sum` for a DTensor of logits [B, S, V] sharded on V over tp."""
    flat, vocab_start, group = _local_rows(logits)
    target = targets.reshape(-1)
    mask = target != ignore_index
    ce, log_z = _VocabParallelCE.apply(flat, target.masked_fill(~mask, 0), vocab_start, group)
    ce_sum = (ce * mask).sum()
    if z_loss > 0:
        z_sum = z_loss * (log_z.square() * mask).sum()
    else:
        z_sum = torch.zeros((), device=flat.device)
    return TokenLoss(ce_sum=ce_sum, z_sum=z_sum, tokens=mask.sum())


def target_logps(logits, targets: torch.Tensor) -> torch.Tensor:
    """`trainer.loss.target_logps` for a DTensor of logits [B, S, V] sharded on V over tp: log p(target) is
    minus the cross-entropy above, so DPO's and GRPO's log-probs never gather the full logits either."""
    flat, vocab_start, group = _local_rows(logits)
    ce, _ = _VocabParallelCE.apply(flat, targets.reshape(-1).clamp_min(0), vocab_start, group)
    return -ce.view(targets.shape)
