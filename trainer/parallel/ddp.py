"""Data parallel: torch DDP over the mesh's dp group (seed: "bucketing groups gradients into buffers of
~25-100 MB ... and overlap starts all-reducing the last layers' bucket while backward is still
computing earlier layers"). DDP registers autograd hooks that launch each bucket's all-reduce as
soon as its gradients are ready; the loop uses `no_sync()` on all but the last micro-batch so
accumulation all-reduces once per step."""

from __future__ import annotations

import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .mesh import ParallelDims


def apply_ddp(model: nn.Module, dims: ParallelDims, bucket_mb: float, group=None,
              ignore: list[str] = ()) -> DistributedDataParallel:
    """DDP over `group` (default: the dp group; context parallel passes dp x cp), leaving the
    parameters named in `ignore` (expert-parallel experts) out of the all-reduce."""
    device_ids = None
    if dims.device_type == "cuda":
        device_ids = [next(model.parameters()).device.index]
    # Buffers are synced once at init, not every forward: the MoE routing bias stays identical on all
    # ranks because each rank applies the same all-reduced loads (trainer.step.train_step).
    kwargs = {"forward_sync_buffers": False}
    if "forward_sync_buffers" not in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs = {"broadcast_buffers": False}  # older torch
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    return DistributedDataParallel(
        model,
        process_group=group if group is not None else dims.group("dp"),
        device_ids=device_ids,
        bucket_cap_mb=bucket_mb,
        gradient_as_bucket_view=True,
        **kwargs,
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside the DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
