"""bf16 matmuls as bf16 hardware computes them, on CPUs that have no bf16 GEMM.

A GPU tensor core, or a CPU with bf16 units (AVX512-BF16, AMX, Arm BF16), multiplies bf16 operands
exactly, sums the products in fp32 and rounds the output to bf16. torch runs a CPU bf16 GEMM through
oneDNN only where oneDNN has a bf16 path (`use_mkldnn_bf16_matmul` in aten/src/ATen/native/mkldnn/
Matmul.cpp: oneDNN enabled and `mkldnn_bf16_device_check`, i.e. AVX512 or newer on x86, BF16 on Arm);
elsewhere it falls back to a generic kernel about 40x slower than its fp32 GEMM (an AVX2 CPU: 1.9 vs
76 GFLOP/s on 2048x256 @ 256x704). There the same numbers come from upcasting the bf16 operands to fp32
(exact: a bf16 value is an fp32 value with a shorter significand), one fp32 GEMM (a product of two 8-bit
significands is exact in fp32's 24) and the output rounded to bf16. Only the order of the fp32 sums can
differ, as it does between any two GEMM kernels.

`bf16_gemm` is that GEMM as one operator (eightfold::bf16_gemm), so that autograd saves its bf16
operands (nothing new is held in fp32 beyond one GEMM's transient operands), selective activation
checkpointing keeps its bf16 output, DTensor shards it like aten.mm and the FLOP counter counts it.
`linear` and `Linear` use it for the model's linear layers, forward and both gradients; `mm` for the
fused LM head. Everywhere else (CUDA, a CPU with a bf16 GEMM, fp32 compute) they are torch's own ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

BF16 = torch.bfloat16


@functools.cache
def _cpu_has_bf16_gemm() -> bool:
    """torch's own test for a oneDNN bf16 GEMM on this CPU (`torch.backends.cpu.get_cpu_capability()`
    names the vector ISA ATen's kernels use, not whether oneDNN has bf16)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def emulates_bf16_gemm(device: torch.device | str) -> bool:
    """Whether a bf16 GEMM on `device` runs here as an fp32 GEMM of the upcast operands: on a CPU where
    torch would take its slow generic bf16 kernel (no oneDNN bf16 path, or oneDNN switched off)."""
    return torch.device(device).type == "cpu" and not (torch.backends.mkldnn.enabled and _cpu_has_bf16_gemm())


@torch.library.custom_op("eightfold::bf16_gemm", mutates_args=(), device_types="cpu")
def bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], both bf16 -> bf16 [M, N]: exact products, fp32 sums, one rounding."""
    if a.dtype != BF16 or b.dtype != BF16:
        raise ValueError(f"eightfold::bf16_gemm takes bf16 operands, got {a.dtype} and {b.dtype}")
    with torch.autocast("cpu", enabled=False):  # an enclosing autocast would cast the fp32 operands back
        return torch.mm(a.float(), b.float()).to(BF16)


@bf16_gemm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=BF16)


def _save_operands(ctx, inputs, output) -> None:
    a, b = inputs  # bf16: what the backward multiplies by, and all that is kept for it
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)


def _gemm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = grad.to(BF16)  # the incoming gradient is the next GEMM's bf16 operand, as on the hardware
    grad_a = bf16_gemm(grad, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = bf16_gemm(a.t(), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


bf16_gemm.register_autograd(_gemm_backward, setup_context=_save_operands)


def _register_flop_formula() -> None:
    from torch.utils.flop_counter import mm_flop, register_flop_formula

    # mm_flop is torch's registered formula for aten.mm, already taking shapes: registered as is
    register_flop_formula(torch.ops.eightfold.bf16_gemm, get_raw=True)(mm_flop)


def _register_dtensor_sharding() -> None:
    """aten.mm's placements on each mesh dimension (tensor parallel's column- and row-wise linears): rows
    of a, columns of b, or the contracted dimension (each rank's partial sum rounded to bf16, as a bf16
    aten.mm on a DTensor gives before its reduction)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.eightfold.bf16_gemm.default)
    def _(a, b):
        return [
            ([Replicate()], [Replicate(), Replicate()]),
            ([Shard(0)], [Shard(0), Replicate()]),
            ([Shard(1)], [Replicate(), Shard(1)]),
            ([Partial()], [Shard(1), Shard(0)]),
        ]


_register_flop_formula()
_register_dtensor_sharding()


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.mm(a, b, out=out) for 2-D operands of one dtype, through `bf16_gemm` where that emulates
    a bf16 GEMM torch would run slowly."""
    if a.dtype == BF16 and b.dtype == BF16 and emulates_bf16_gemm(a.device):
        y = bf16_gemm(a, b)
        return y if out is None else out.copy_(y)
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


def _gemm_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype F.linear would multiply in: autocast's for fp32/bf16 operands when it is on, else the
    operands' shared dtype (None when they differ: F.linear's own error then says so)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and {x.dtype, weight.dtype} <= {torch.float32, BF16}:
        return torch.get_autocast_dtype(device)
    return x.dtype if x.dtype == weight.dtype else None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (x [.., K], weight [N, K], no bias); a bf16 product on a CPU without a bf16
    GEMM goes through `bf16_gemm`, forward and backward, with autocast's casts of the operands."""
    if _gemm_dtype(x, weight) != BF16 or not emulates_bf16_gemm(x.device):
        return F.linear(x, weight)
    y = bf16_gemm(x.to(BF16).reshape(-1, x.shape[-1]), weight.to(BF16).t())
    return y.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """A bias-free nn.Linear whose bf16 products take `linear`'s path (the model's linear layers)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        if bias:
            raise ValueError("Linear: the model's linear layers have no bias")
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
