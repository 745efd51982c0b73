"""Launchers: hand a job file to torchrun on this machine, to Slurm or to Kubernetes; wait, stream
logs, cancel, and read the job's `result.json`. `get_launcher(cfg)` picks one from `infra.launcher`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from infra.launch.base import JobHandle, JobState, Launcher, read_result, write_result
from infra.launch.job import JobResult, JobSpec, TrackingRef
from infra.launch.local import LocalJob, LocalLauncher

if TYPE_CHECKING:
    from infra.config import LifecycleConfig


def get_launcher(cfg: "LifecycleConfig", module: str = "trainer", echo: bool = False) -> Launcher:
    """The launcher `infra.launcher` names, sized from `parallel:` (nnodes x nproc_per_node)."""
    kind = cfg.infra.launcher
    if kind == "local":
        return LocalLauncher(
            cfg.parallel.nproc_per_node,
            cfg.parallel.nnodes,
            module=module,
            max_restarts=cfg.pretrain.max_restarts,  # each restart resumes from the latest checkpoint
            env={"EIGHTFOLD_DEVICE": cfg.infra.device},
            echo=echo,
        )
    if kind == "slurm":
        from infra.launch.slurm import SlurmLauncher
        from infra.workspace import Workspace

        return SlurmLauncher.from_config(cfg, Workspace.from_config(cfg).workdir, module=module,
                                         env={"EIGHTFOLD_DEVICE": cfg.infra.device})
    if kind == "kubernetes":
        from infra.launch.kubernetes import KubernetesLauncher
        from infra.workspace import Workspace

        return KubernetesLauncher.from_config(cfg, Workspace.from_config(cfg).workdir, module=module,
                                              env={"EIGHTFOLD_DEVICE": cfg.infra.device})
    raise ValueError(f"infra.launcher={kind!r}: unknown launcher (local, slurm, kubernetes)")


__all__ = [
    "JobHandle",
    "JobResult",
    "JobSpec",
    "JobState",
    "Launcher",
    "LocalJob",
    "LocalLauncher",
    "TrackingRef",
    "get_launcher",
    "read_result",
    "write_result",
]
