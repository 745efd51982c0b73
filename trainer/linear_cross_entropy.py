"""The LM head fused with the token cross-entropy (and z-loss): hidden [T, D] and the head weight
[V, D] go in, summed losses come out, and the full [T, V] logits are never materialised in fp32.

Why: with vocab >> dim the head and its softmax dominate a small model's step. The unfused path
writes bf16 logits, an fp32 copy, fp32 log-probabilities, an fp32 gradient of the same size and its
bf16 cast; here the rows are processed in chunks that stay in cache (logits of one chunk, their
softmax, and the gradient of the loss with respect to them, all in place), as in Liger Kernel's
fused linear cross-entropy and Apple's Cut Cross-Entropy (Wijmans et al. 2024).

The gradients with respect to hidden and weight are computed during the forward (the loss is a sum,
so d loss / d logits is known as soon as the softmax is): the backward only scales them by the
incoming gradient. That needs the same three matmuls as the unfused head (logits, d hidden, d weight)
and keeps just [T, D] + [V, D] for the backward instead of [T, V] logits.

Numerics follow autocast's: matmuls in the compute dtype (bf16 under autocast; on a CPU without a bf16
GEMM, as fp32 GEMMs of the bf16 operands rounded to bf16: model/bf16_matmul.py) with bf16 logits,
softmax, log-sum-exp and losses in fp32, the logits' gradient cast to the compute dtype for the two
gradient matmuls, and the weight gradient returned in the weight's dtype.
"""

from __future__ import annotations

import torch

from .model.bf16_matmul import mm
from .model.transformer import compute_dtype

IGNORE_INDEX = -100

# Rows per softmax chunk: about 1 M fp32 logits (4 MB, cache-sized on a CPU core), at least 64 rows
# so the logits matmul stays efficient. Rows per weight-gradient block: the logits' gradient of a
# block is kept (in the compute dtype) for one large [V, rows] x [rows, D] matmul, bounded to about
# 64 M elements so memory stays below what the unfused head's bf16 logits alone would take.
CHUNK_ELEMENTS = 1 << 20
BLOCK_ELEMENTS = 1 << 26


def _rows(elements: int, vocab: int, floor: int) -> int:
    return max(floor, elements // max(vocab, 1))


def _softmax_chunk(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor,
                   buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of one chunk into `buf` (fp32), left there as exp(logit - row max); returns the
    log-sum-exp, the target's logit and the sum of the exps, each [n, 1] fp32."""
    if x.dtype == torch.float32:
        torch.mm(x, w.t(), out=buf)
    else:
        buf.copy_(mm(x, w.t()))  # compute-dtype logits, as autocast's linear would give, then fp32
    target_logit = buf.gather(1, target)
    row_max = buf.amax(dim=1, keepdim=True)
    buf.sub_(row_max).exp_()
    sum_exp = buf.sum(dim=1, keepdim=True)
    return row_max + sum_exp.log(), target_logit, sum_exp


def _logit_grad(buf: torch.Tensor, target: torch.Tensor, sum_exp: torch.Tensor, lse: torch.Tensor,
                valid: torch.Tensor, g_ce, g_z, z_loss: float, out: torch.Tensor) -> None:
    """d/d logits of g_ce * CE + g_z * z_loss * lse^2 for the chunk whose exp(logit - max) is in `buf`,
    written to `out` (compute dtype): softmax * (g_ce + 2 g_z z_loss lse) - g_ce * onehot(target), zero
    on ignored rows (PaLM's z-loss: d(lse^2)/d logits = 2 lse softmax)."""
    row_scale = valid * (g_ce + (2.0 * z_loss) * g_z * lse) if z_loss > 0 else valid * g_ce
    buf.mul_(row_scale / sum_exp)  # softmax * row_scale
    buf.scatter_(1, target, buf.gather(1, target) - valid * g_ce)  # in fp32: one rounding, at the cast
    out.copy_(buf)  # (a separate cast: torch.mul(..., out=<bf16>) takes a slow path on CPU)


def _blocks(total: int, vocab: int, chunk_rows: int):
    block_rows = max(chunk_rows, _rows(BLOCK_ELEMENTS, vocab, chunk_rows) // chunk_rows * chunk_rows)
    for start in range(0, total, block_rows):
        yield start, min(total, start + block_rows)


def _loss_and_grads(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, z_loss: float, ignore_index: int,
                    need_x: bool, need_w: bool, g_ce=1.0, g_z=1.0):
    """x [T, D], w [V, D] (compute dtype), targets [T] -> (ce_sum, z_sum, grad_x or None, grad_w fp32 or None)."""
    T, V = x.shape[0], w.shape[0]
    chunk = _rows(CHUNK_ELEMENTS, V, 64)
    need_grad = need_x or need_w
    valid_all = targets != ignore_index
    safe_targets = torch.where(valid_all, targets, torch.zeros_like(targets))[:, None]
    valid_all = valid_all[:, None].float()
    ce_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    z_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if need_x else None
    grad_w = None
    buf = torch.empty(min(chunk, T), V, dtype=torch.float32, device=x.device)
    for b0, b1 in _blocks(T, V, chunk):
        g_block = torch.empty(b1 - b0, V, dtype=x.dtype, device=x.device) if need_grad else None
        for s in range(b0, b1, chunk):
            e = min(b1, s + chunk)
            chunk_buf, target, valid = buf[: e - s], safe_targets[s:e], valid_all[s:e]
            lse, target_logit, sum_exp = _softmax_chunk(x[s:e], w, target, chunk_buf)
            ce_sum += ((lse - target_logit) * valid).sum()
            if z_loss > 0:
                z_sum += z_loss * (lse.square() * valid).sum()
            if need_grad:
                _logit_grad(chunk_buf, target, sum_exp, lse, valid, g_ce, g_z, z_loss, g_block[s - b0 : e - b0])
        if need_x:
            mm(g_block, w, out=grad_x[b0:b1])
        if need_w:
            part = mm(g_block.t(), x[b0:b1])
            grad_w = part.float() if grad_w is None else grad_w.add_(part)
    return ce_sum, z_sum, grad_x, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, z_loss, ignore_index, compute_dtype):
        xc, wc = x.to(compute_dtype), weight.to(compute_dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            ce_sum, z_sum, grad_x, grad_w = _loss_and_grads(xc, wc, targets, z_loss, ignore_index, need_x, need_w)
        ctx.z_loss, ctx.ignore_index, ctx.x_dtype, ctx.w_dtype = z_loss, ignore_index, x.dtype, weight.dtype
        # The precomputed gradients, and (only when z-loss is on) what the exact recomputation needs
        # should the two losses come back with different incoming gradients.
        ctx.save_for_backward(grad_x, grad_w, *((xc, wc, targets) if z_loss > 0 else ()))
        return ce_sum, z_sum

    @staticmethod
    def backward(ctx, g_ce, g_z):
        grad_x, grad_w, *inputs = ctx.saved_tensors
        if ctx.z_loss > 0 and not torch.equal(g_ce, g_z):
            # Rare (a caller weighting CE and z-loss differently, e.g. fault injection scaling ce_sum):
            # recompute the logits and take the exact gradient of g_ce * CE + g_z * Z.
            xc, wc, targets = inputs
            with torch.autocast(xc.device.type, enabled=False):
                _, _, grad_x, grad_w = _loss_and_grads(xc, wc, targets, ctx.z_loss, ctx.ignore_index, grad_x is not None,
                                                       grad_w is not None, g_ce.float(), g_z.float())
            g_ce = None
        dx = None if grad_x is None else (grad_x if g_ce is None else grad_x * g_ce).to(ctx.x_dtype)
        dw = None if grad_w is None else (grad_w if g_ce is None else grad_w * g_ce).to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             z_loss: float = 0.0, ignore_index: int = IGNORE_INDEX
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [.., D], weight [V, D], targets [..] (rows whose target is ignore_index count nothing) ->
    (ce_sum, z_sum, tokens): the same sums as `cross_entropy_sum(hidden @ weight.T, targets, z_loss)`."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on the token dims")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden dim {hidden.shape[-1]} != head weight's input dim {weight.shape[-1]}")
    x = hidden.reshape(-1, hidden.shape[-1])
    target = targets.reshape(-1).to(x.device)
    dtype = compute_dtype(hidden)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        ce_sum, z_sum = _LinearCrossEntropy.apply(x, weight, target, float(z_loss), ignore_index, dtype)
    else:  # evaluation: the sums alone
        with torch.autocast(x.device.type, enabled=False):
            ce_sum, z_sum, _, _ = _loss_and_grads(x.to(dtype), weight.to(dtype), target, float(z_loss), ignore_index,
                                                  False, False)
    return ce_sum, z_sum, (target != ignore_index).sum()
