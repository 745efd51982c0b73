"""Elementwise pieces of the block with their backward written out by hand, for eager execution.

Composed from single torch ops, RMSNorm's autograd graph makes about a dozen passes over [B, S, D]
(square, mean, rsqrt, two products, a cast, and the backward of each); on a CPU, where these passes
are bound by memory rather than arithmetic, that costs as much as a sizeable matmul. Here the
forward keeps only x and the per-row 1/rms, and the backward is the closed form
    x_hat = x * r,  dx = r * (g w - x_hat * mean(g w * x_hat)),  dw = sum over rows of g * x_hat.
Under torch.compile (which fuses the composite form itself) and on DTensors (tensor/sequence
parallel), the composite form is used instead: same numbers, computed in fp32 either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        xf = x.float()
        # 1 / sqrt(mean(x^2) + eps), from the L2 norm in one pass: |x|^2 / D = mean(x^2)
        rstd = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        y = (xf * rstd).mul_(weight.float())
        ctx.save_for_backward(x, weight, rstd)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        g = grad_y.float()
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * x_hat).sum(dim=tuple(range(x.dim() - 1))).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = g.mul_(weight.float()) if g is not grad_y else g * weight.float()  # never write into grad_y
            mean_gx = (gw * x_hat).mean(dim=-1, keepdim=True)
            grad_x = gw.sub_(x_hat.mul_(mean_gx)).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32, returned in `out_dtype`."""
    if torch.compiler.is_compiling() or hasattr(x, "placements") or hasattr(weight, "placements"):
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(out_dtype)
    return _RMSNorm.apply(x, weight, eps, out_dtype)
