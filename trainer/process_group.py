"""Joining the default process group torchrun describes, with the collective timeout and, on CUDA,
this rank's GPU (trainer/parallel/mesh.py: process_group_args); every later group copies its timeout."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from infra.config import LifecycleConfig

from .parallel.mesh import pick_device, process_group_args
from .recovery import attempt_store


def init_distributed(cfg: LifecycleConfig) -> None:
    """Join the process group torchrun describes (nothing to do for one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    device, backend = pick_device(cfg.parallel.backend, cfg.infra.device)
    args = process_group_args(cfg.parallel, backend, device)  # every later group copies its timeout
    store = attempt_store(max(args["timeout"], timedelta(seconds=60)))  # torchrun restarts: per-attempt keys
    if store is None:
        dist.init_process_group(**args)
    else:
        dist.init_process_group(**args, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
