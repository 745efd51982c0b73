"""Counting collectives: calls and bytes per step, by mesh dimension, forward vs backward.

`CommCounter` is torch's `CommDebugMode` (a dispatch mode that sees the collectives DTensor desugars
into, and every c10d collective issued from Python or C++ - DDP's reducer, FSDP2, our ZeRO-1) extended
to record each collective's size and process group. Bytes are per rank on the wire under the ring
algorithms (seed: "split the gradient into N chunks and pass them around a ring of GPUs twice"):

    all-reduce           2 (d-1)/d * N      (a reduce-scatter followed by an all-gather)
    reduce-scatter       (d-1)/d * N        N = the full (unsharded) buffer
    all-gather           (d-1)/d * N
    all-to-all           (d-1)/d * N        with uneven splits (expert parallel's dispatch/combine):
                                             exactly the rows sent to the other ranks
    broadcast / scatter  N (upper bound)
    send                 N                  (point to point: ring attention's K/V hops, pipeline
                                             boundaries; a receive is the sender's bytes, not counted)

so ZeRO-1 (reduce-scatter + all-gather) moves what DDP's all-reduce moves and ZeRO-3 (all-gather in
forward and again in backward, reduce-scatter of gradients) 1.5x that.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter", "allgather": "all_gather", "all_gather": "all_gather",
    "alltoall": "all_to_all", "all_to_all": "all_to_all", "broadcast": "broadcast", "scatter": "scatter",
    "gather": "gather", "reduce": "reduce", "send": "send",
}
# Point-to-point sends (isend / batch_isend_irecv dispatch c10d.send; CommDebugMode counts collectives only).
P2P_SEND_OPS = {torch.ops.c10d.send}


def kind_of(op_name: str) -> str:
    name = op_name.split(".")[-2] if op_name.count(".") >= 2 else op_name
    for key in sorted(KINDS, key=len, reverse=True):  # longest first: reduce_scatter before reduce
        if key in name:
            return KINDS[key]
    return name


def wire_factor(kind: str, d: int) -> float:
    if d <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (d - 1) / d
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (d - 1) / d
    return 1.0


@dataclass
class Collective:
    kind: str  # all_reduce, reduce_scatter, all_gather, all_to_all, ...
    dim: str  # mesh dimension name (or "world" / "other")
    group_size: int
    elements: int  # the full buffer N
    element_size: int
    backward: bool
    sent: int | None = None  # elements sent to other ranks, when the splits say (uneven all-to-all)

    @property
    def wire_bytes(self) -> float:
        if self.sent is not None:
            return self.sent * self.element_size
        return wire_factor(self.kind, self.group_size) * self.elements * self.element_size


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _sent_off_rank(name: str, args, pg) -> int | None:
    """Elements an uneven all-to-all (c10d.alltoall_base_: output, input, group, output_splits,
    input_splits) sends to the other ranks: the input less the rows it keeps. None for anything else."""
    if "alltoall_base" not in name or pg is None or len(args) < 5:
        return None
    source, splits = args[1], args[4]
    if not isinstance(source, torch.Tensor) or not splits or source.shape[0] != sum(splits):
        return None  # even splits: the (d-1)/d rule is exact
    row = source.numel() // max(source.shape[0], 1)
    return (source.shape[0] - splits[pg.rank()]) * row


class CommCounter(CommDebugMode):
    """Use as a context manager around one step; `records` lists every collective, `summary()` sums
    calls and bytes by mesh dimension. `group_names` maps process-group names to mesh dimensions
    (`ParallelDims.group_names()`)."""

    def __init__(self, group_names: dict[str, str] | None = None):
        super().__init__()
        self.group_names = dict(group_names or {})
        self.records: list[Collective] = []
        self._by_ranks: dict[tuple, str] | None = None

    # CommDebugMode's per-module tracker (forward hooks on every module) trips over activation
    # checkpointing and FSDP's hooks; the counts here need only the dispatch, so it is left out.
    def __enter__(self):
        self.comm_counts.clear()
        self.records.clear()
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args):
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into collectives first, as CommDebugMode does
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in self.comm_registry or packet in c10d_collective_ops or packet in P2P_SEND_OPS:
            self.comm_counts[packet] += 1
            self._record(str(func), args, kwargs)
        return out

    def _record(self, name: str, args, kwargs) -> None:
        kind = kind_of(name)
        group_name, size, pg = None, None, None
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError):
                    continue  # a ReduceOp
                group_name, size = pg.group_name, pg.size()
            elif isinstance(a, str):
                group_name = a  # functional collectives name their group last (after e.g. "sum")
        if size is None and group_name is not None:
            try:
                size = dist.distributed_c10d._resolve_process_group(group_name).size()
            except Exception:  # noqa: BLE001 - an unknown name still counts, with d unknown
                size = 1
        tensors = [t for a in args for t in _tensors(a)]
        if not tensors:
            return
        # The full buffer: the largest tensor list argument (output of a gather, input of a scatter).
        per_arg = [sum(t.numel() for t in _tensors(a)) for a in args]
        elements = max(per_arg)
        if kind == "all_gather" and "c10d_functional" in name:
            elements = tensors[0].numel() * (size or 1)  # functional all-gather gets only the shard
        dim = self.group_names.get(group_name) or self._dim_by_ranks(group_name, size)
        self.records.append(Collective(kind=kind, dim=dim, group_size=size or 1, elements=elements,
                                       element_size=tensors[0].element_size(),
                                       backward=torch._C._current_graph_task_id() != -1,
                                       sent=_sent_off_rank(name, args, pg)))

    def _dim_by_ranks(self, group_name: str | None, size: int | None) -> str:
        """A group not in the table (another mesh object over the same ranks, e.g. a cached one) is
        named after the dimension whose group has exactly its ranks."""
        resolve = dist.distributed_c10d._resolve_process_group
        try:
            ranks = tuple(dist.get_process_group_ranks(resolve(group_name)))
        except Exception:  # noqa: BLE001
            ranks = None
        if ranks is not None:
            if self._by_ranks is None:
                self._by_ranks = {}
                for name, dim in self.group_names.items():
                    try:
                        self._by_ranks.setdefault(tuple(dist.get_process_group_ranks(resolve(name))), dim)
                    except Exception:  # noqa: BLE001
                        pass
            if ranks in self._by_ranks:
                return self._by_ranks[ranks]
        return "world" if size == dist.get_world_size() else "other"

    def summary(self) -> dict[str, dict[str, float]]:
        """{dim: {"calls": n, "bytes": wire bytes per rank, "<kind>_calls": n, ...}}."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for r in self.records:
            s = out[r.dim]
            s["calls"] += 1
            s["bytes"] += r.wire_bytes
            s[f"{r.kind}_calls"] += 1
        return {k: dict(v) for k, v in out.items()}

    def metrics(self, prefix: str = "comm") -> dict[str, float]:
        """Flat names for the step metrics: comm_bytes/<dim>, comm_calls/<dim>."""
        flat = {}
        for dim, s in self.summary().items():
            flat[f"{prefix}_bytes/{dim}"] = s["bytes"]
            flat[f"{prefix}_calls/{dim}"] = s["calls"]
        return flat


class StepComm:
    """The trainer's hook: count the collectives of the first step (the pattern repeats every step)
    and hand back `comm_bytes/<dim>` and `comm_calls/<dim>` to log with every step's metrics. Off on
    one process and under torch.compile (a dispatch mode would get in the compiler's way)."""

    def __init__(self, dims, enabled: bool = True):
        self.dims = dims
        self.pending = enabled and dims.world_size > 1
        self.metrics: dict[str, float] = {}

    def count(self):
        if not self.pending:
            return _Null()
        self.pending = False
        return _Counting(self)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False


class _Counting:
    def __init__(self, owner: StepComm):
        self.owner = owner
        self.counter = CommCounter(owner.dims.group_names())

    def __enter__(self):
        return self.counter.__enter__()

    def __exit__(self, *args):
        self.counter.__exit__(*args)
        self.owner.metrics = self.counter.metrics()
        return False
