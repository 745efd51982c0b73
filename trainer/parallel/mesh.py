"""One DeviceMesh from `parallel:`; every process group comes from it.

Dimension order, outermost to innermost: dp_replicate, dp_shard, pp, cp, tp (seed: "The more often a
group talks, the closer its members must sit": tp innermost on NVLink, dp outermost). Only
dimensions larger than 1 are built into the mesh (as TorchTitan does), but every name stays
resolvable: `dims.group("tp")` is None and `dims.size("tp")` is 1 when tp is off. "dp" names the
whole data-parallel group (dp_replicate x dp_shard); `data_context_group` the dp x cp ranks that hold
the same weights and see different tokens. Expert parallel reuses those ranks: "ep" and "ep_replica"
are dimensions cut from them (`expert_mesh`).

Every process group gets `parallel.collective_timeout_s`: init_process_group gives it to the default
group, and every group made after it (the mesh's dimensions, flattened dimensions, expert groups, the
checkpoint's gloo group) copies the default group's timeout through `new_group` / `group_options` here.
torch would give them its backend default instead (30 min on gloo, 10 min on nccl), so a rank hung on a
tp or pp collective would hold its peers that long.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

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
        if name == "ep_replica":  # ranks holding the same experts: the dp x cp ranks over ep
            return self.dp * self.cp // self.ep
        if name not in ORDER + ("ep",):
            raise KeyError(f"unknown mesh dimension {name!r}; known: dp, {', '.join(ORDER)}, ep, ep_replica")
        return getattr(self, name)

    def group(self, name: str):
        """The process group of dimension `name`, or None when that dimension has size 1."""
        if self.size(name) == 1:
            return None
        if name not in self._groups:
            if name in ("ep", "ep_replica"):
                experts = expert_mesh(self)
                for n in experts.mesh_dim_names:
                    self._groups[n] = experts[n].get_group()
            elif name == "dp" and self.dp_replicate > 1 and self.dp_shard > 1:
                self._groups[name] = self.flatten(("dp_replicate", "dp_shard"), "dp").get_group()
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

    def flatten(self, names: tuple[str, ...], name: str):
        """The 1-D mesh over the mesh dimensions `names` flattened into one, called `name` (a new
        process group unless it spans the whole world, which is the default group)."""
        sub = self.mesh[names[0]] if len(names) == 1 else self.mesh[names]
        size = sub.size()
        override = group_options() if size < dist.get_world_size() else None
        return sub._flatten(name, backend_override=override)

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

        # A dimension spanning the whole world reuses the default group (torch does so only without
        # an override); every other dimension's groups get the collective timeout.
        override = {n: group_options() for n, s in active if s < world}
        dims.mesh = init_device_mesh(
            device_type, tuple(s for _, s in active), mesh_dim_names=tuple(n for n, _ in active),
            backend_override=override or None,
        )
    return dims


# --- the dp x cp group ---------------------------------------------------------------------------
def flat_group(dims: ParallelDims, names: tuple[str, ...]):
    """The process group spanning the mesh dimensions `names` (those of size 1 are skipped), derived
    from the one DeviceMesh; None when they are all 1."""
    present = tuple(n for n in names if dims.size(n) > 1 and dims.mesh is not None and n in dims.mesh.mesh_dim_names)
    if not present:
        return None
    if set(present) <= {"dp_replicate", "dp_shard"}:
        return dims.group("dp")  # the mesh's own dp group (HSDP flattens it once, as "dp")
    # Kept with this mesh's own groups: a cache keyed by id(mesh) could hand a later mesh (same id once
    # the first is freed, another layout) the first one's group.
    key = present
    if key not in dims._groups:
        sub = dims.mesh[present[0]] if len(present) == 1 else dims.flatten(present, "_".join(present))
        dims._groups[key] = sub.get_group()
    return dims._groups[key]


def data_context_group(dims: ParallelDims):
    """Ranks that hold the same weights and see different tokens: dp x cp. Gradients are summed and
    token counts agreed over it."""
    return flat_group(dims, ("dp_replicate", "dp_shard", "cp"))


def expert_mesh(dims: ParallelDims):
    """Expert parallel's dimensions, cut from the mesh's dp x cp ranks (the ranks of `data_context_group`,
    in mesh order): "ep", consecutive blocks of `ep` ranks that share out the experts, and, when there
    is more than one block, "ep_replica", the ranks at the same place in every block, which hold the
    same experts. Both get the collective timeout."""
    present = tuple(n for n in ("dp_replicate", "dp_shard", "cp") if n in dims.mesh.mesh_dim_names)
    name = "dp" if set(present) == {"dp_replicate", "dp_shard"} else "_".join(present)  # as group("dp") names it
    data = dims.mesh[present[0]] if len(present) == 1 else dims.flatten(present, name)
    replicas = data.size() // dims.ep
    if replicas > 1:
        return data._unflatten(0, (replicas, dims.ep), ("ep_replica", "ep"),
                               backend_override={"ep_replica": group_options(), "ep": group_options()})
    return data._unflatten(0, (dims.ep,), ("ep",), backend_override={"ep": group_options()})


# --- process groups and their timeout -------------------------------------------------------------
def collective_timeout(parallel: ParallelConfig, device_type: str) -> timedelta:
    """`parallel.collective_timeout_s`, or 600 s on GPU and 60 s on CPU."""
    return timedelta(seconds=parallel.collective_timeout_s or (600 if device_type == "cuda" else 60))


def process_group_args(parallel: ParallelConfig, backend: str, device: torch.device) -> dict:
    """init_process_group's arguments. On CUDA the group is bound to this rank's GPU (device_id): NCCL
    creates its communicator at once instead of at the first collective, on the right device, and the
    mesh's groups are split from it (ncclCommSplit) rather than each built from scratch."""
    args = {"backend": backend, "timeout": collective_timeout(parallel, device.type)}
    if device.type == "cuda":
        args["device_id"] = torch.device("cuda", device.index if device.index is not None
                                         else int(os.environ.get("LOCAL_RANK", "0")))
    return args


def group_timeout() -> timedelta:
    """The default process group's timeout (what init_process_group was given): every later group
    copies it. Read from the group itself, so a job, a test or a benchmark that joined the world with
    its own timeout passes that one on."""
    pg = dist.distributed_c10d._get_default_group()
    device = pg.bound_device_id or torch.device(pg._device_types[0])
    return pg._get_backend(device).options._timeout


def group_options(backend: str | None = None):
    """Backend options that carry the collective timeout, for DeviceMesh's `backend_override` (the
    mesh passes their `_timeout` on to new_group / split_group)."""
    backend = backend or dist.get_backend()
    timeout = group_timeout()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # new_group's own default for NCCL
    else:
        from torch._C._distributed_c10d import Backend as C10dBackend

        options = C10dBackend.Options(backend, timeout)
    options._timeout = timeout
    return options


def new_group(ranks: list[int] | None = None, backend: str | None = None):
    """dist.new_group with the collective timeout. Every rank calls it for every group, in the same
    order (new_group's rule)."""
    return dist.new_group(ranks, timeout=group_timeout(), backend=backend)


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
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"
