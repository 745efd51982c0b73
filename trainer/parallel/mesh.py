"""One DeviceMesh from `parallel:`; every process group comes from it.

Dimension order, outermost to innermost: dp_replicate, dp_shard, pp, cp, tp (seed: "The more often a
group talks, the closer its members must sit": tp innermost on NVLink, dp outermost). Only
dimensions larger than 1 are built into the mesh (as TorchTitan does), but every name stays
resolvable: `dims.group("tp")` is None and `dims.size("tp")` is 1 when tp is off. "dp" names the
whole data-parallel group (dp_replicate x dp_shard). Expert parallel reuses dp x cp ranks (later issue).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from infra.config.parallel import ParallelConfig

ORDER = ("dp_replicate", "dp_shard", "pp", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    device_type: str = "cpu"
    mesh: object | None = None  # torch DeviceMesh over the dims > 1; None on one process
    _groups: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def size(self, name: str) -> int:
        if name == "dp":
            return self.dp
        if name not in ORDER + ("ep",):
            raise KeyError(f"unknown mesh dimension {name!r}; known: dp, {', '.join(ORDER)}, ep")
        return getattr(self, name)

    def group(self, name: str):
        """The process group of dimension `name`, or None when that dimension has size 1."""
        if self.size(name) == 1:
            return None
        if name not in self._groups:
            if name == "dp" and self.dp_replicate > 1 and self.dp_shard > 1:
                self._groups[name] = self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
            elif name == "dp":
                self._groups[name] = self.mesh["dp_replicate" if self.dp_replicate > 1 else "dp_shard"].get_group()
            else:
                self._groups[name] = self.mesh[name].get_group()
        return self._groups[name]

    def submesh(self, *names: str):
        """The DeviceMesh over `names` (each larger than 1), e.g. submesh("dp_replicate", "dp_shard")
        for HSDP or submesh("tp") for tensor parallel; None on one process."""
        if self.mesh is None:
            return None
        missing = [n for n in names if n not in self.mesh.mesh_dim_names]
        if missing:
            raise KeyError(f"mesh dimension(s) {missing} are not in the mesh {self.mesh.mesh_dim_names} (size 1?)")
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    def group_names(self) -> dict[str, str]:
        """Process-group name -> dimension name for every dimension larger than 1 (for accounting).
        "dp" wins when it is the same group as dp_replicate or dp_shard."""
        names = {}
        if self.mesh is not None:  # the groups DTensor uses for each dimension of the whole mesh
            for name in self.mesh.mesh_dim_names:
                names[self.mesh.get_group(name).group_name] = name
        for name in ORDER + ("dp",):
            group = self.group(name) if name != "ep" else None
            if group is not None:
                names[group.group_name] = name
        if self.cp > 1 and self.dp > 1:  # gradients and ZeRO-1 under context parallel: the dp x cp group
            from .context_parallel import data_context_group

            names.setdefault(data_context_group(self).group_name, "dp_cp")
        return names

    def rank(self, name: str) -> int:
        """This process's coordinate along `name` (0 when the dimension is off)."""
        group = self.group(name)
        return 0 if group is None else dist.get_rank(group)

    def placement(self) -> str:
        """A table of every global rank's coordinates, for the log at start."""
        if self.mesh is None:
            return "rank 0: single process"
        names = self.mesh.mesh_dim_names
        grid = self.mesh.mesh
        lines = []
        for rank in range(grid.numel()):
            coord = [int(c) for c in (grid == rank).nonzero()[0].tolist()]
            lines.append(f"rank {rank}: " + " ".join(f"{n}={c}" for n, c in zip(names, coord)))
        return "\n".join(lines)


def build_parallel_dims(parallel: ParallelConfig, device_type: str) -> ParallelDims:
    """Sizes from the config (ZeRO 0/1 replicate over all of dp; ZeRO 2/3 shard, HSDP replicates
    `dp_replicate` ways) and, when the world has more than one rank, the mesh itself."""
    if parallel.zero >= 2:
        replicate, shard = parallel.dp_replicate, parallel.dp // parallel.dp_replicate
    else:
        replicate, shard = parallel.dp, 1
    dims = ParallelDims(
        dp_replicate=replicate, dp_shard=shard, pp=parallel.pp, cp=parallel.cp, tp=parallel.tp,
        ep=parallel.ep, device_type=device_type,
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != dims.world_size:
        raise ValueError(
            f"the job runs {world} ranks but parallel: dp*pp*cp*tp = {dims.world_size}; "
            f"set parallel.nproc_per_node/nnodes to match the launcher"
        )
    active = [(n, getattr(dims, n)) for n in ORDER if getattr(dims, n) > 1]
    if world > 1 and active:
        from torch.distributed.device_mesh import init_device_mesh

        dims.mesh = init_device_mesh(
            device_type, tuple(s for _, s in active), mesh_dim_names=tuple(n for n, _ in active)
        )
    return dims


def pick_device(backend: str = "auto", device: str = "auto") -> tuple[torch.device, str]:
    """(device, backend) from `parallel.backend` and `infra.device`: CUDA + nccl when CUDA is present
    and allowed, else CPU + gloo. A contradictory pair is an error that names both fields."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("infra.device=cuda but this machine has no CUDA device")
    if backend == "nccl" and (device == "cpu" or not torch.cuda.is_available()):
        raise RuntimeError(f"parallel.backend=nccl needs CUDA (infra.device={device}, cuda available: "
                           f"{torch.cuda.is_available()})")
    use_cuda = torch.cuda.is_available() and device != "cpu" and backend != "gloo"
    if use_cuda:
        import os

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"
