"""ZeRO-1's optimizer state as torch.distributed.checkpoint (DCP) sees it: sharded tensors of the
parameters' global shapes, so a checkpoint reshards onto any mesh and any optimizer.

A rank's ZeRO-1 segment is a flat range of its local parameter (row-major), and the local parameter
is itself, under tensor parallel, a block of the global one at some offset. A flat range of a
row-major tensor is a few rectangles (at most 3 in 2-d: the tail of a row, whole rows, the head of
a row; 2n-1 in n-d), each contiguous in memory, so each is a view of the segment's flat moments.
Those rectangles, at their global offsets, are the local shards of a `ShardedTensor`, which DCP
writes by global offset and reads back by overlap with whatever the loading layout asks for.

`ShardedTensor` wants a global metadata that covers the tensor without overlap, though DCP reads
only the local shards: the boxes of every rank are gathered once (`ShardTable`); a box that several
ranks hold (a parameter replicated over tp, an expert replicated over ep groups: same bytes) is
listed once, under this rank when it holds it, and DCP's planner writes it once.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_range_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The rectangles, in memory order, that elements [start, stop) of a row-major tensor of `shape`
    cover; each is contiguous in memory."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(lo, hi, shape[1:])]

    if first == last:
        return within(first, start - first * inner, stop - first * inner)
    boxes: list[Box] = []
    if start % inner:
        boxes += within(first, start % inner, inner)
        first += 1
    whole = stop // inner
    if whole > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (whole - first, *shape[1:])))
    if stop % inner:
        boxes += within(whole, 0, stop % inner)
    return boxes


def local_block(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, this rank's local shape, its offset in the global tensor) of a parameter; a plain
    tensor is its own global tensor."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(p.shape), tuple(shape), tuple(offset)
    return tuple(p.shape), tuple(p.shape), (0,) * p.dim()


def segment_boxes(p: torch.Tensor, start: int, length: int) -> list[Box]:
    """The global rectangles of elements [start, start+length) of the local parameter."""
    _, shape, offset = local_block(p)
    return [(tuple(o + b for o, b in zip(offset, off)), size)
            for off, size in flat_range_boxes(start, start + length, shape)]


class ShardTable:
    """Every rank's boxes of every parameter, gathered once over the world (a collective: every rank
    builds it at the same point). `shards(fqn)` is the global metadata of fqn's sharded tensor."""

    def __init__(self, mine: dict[str, list[Box]], device: torch.device):
        self.rank = dist.get_rank()
        gathered: list[dict[str, list[Box]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.holders: dict[str, dict[Box, list[int]]] = {}
        for r, boxes in enumerate(gathered):
            for fqn, bs in (boxes or {}).items():
                for b in bs:
                    self.holders.setdefault(fqn, {}).setdefault((tuple(b[0]), tuple(b[1])), []).append(r)
        self.device = device

    def placement(self, rank: int) -> str:
        dev = self.device
        return f"rank:{rank}/{dev.type}" + (f":{dev.index}" if dev.index is not None else "")

    def shards(self, fqn: str) -> list[ShardMetadata]:
        return [ShardMetadata(list(off), list(size),
                              self.placement(self.rank if self.rank in ranks else min(ranks)))
                for (off, size), ranks in self.holders[fqn].items()]


def sharded(flat: torch.Tensor, boxes: Iterable[Box], global_shape: Sequence[int], metadata: list[ShardMetadata],
            rank: int) -> ShardedTensor:
    """A ShardedTensor whose local shards are views of `flat` (the segment's elements, in the order of
    `boxes`): DCP reads into them in place and stages from them."""
    placement = {tuple(m.shard_offsets): m for m in metadata if m.placement.rank() == rank}
    local, at = [], 0
    for off, size in boxes:
        n = math.prod(size)
        local.append(Shard(flat[at:at + n].view(size), placement[tuple(off)]))
        at += n
    if at != flat.numel():
        raise ValueError(f"boxes cover {at} elements, the segment has {flat.numel()}")
    meta = ShardedTensorMetadata(metadata, torch.Size(global_shape), TensorProperties(dtype=flat.dtype))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)

