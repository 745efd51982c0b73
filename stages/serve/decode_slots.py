"""Contiguous K/V of decoding requests, one row ("slot") per request, kept next to the paged pool.

A decode step's attention reads every running request's whole context. Read from the paged pool,
that means gathering each request's blocks into a padded copy for every layer of every step; on
CPU that copy (and reading it back) is the step's largest memory traffic. Here a request that
decodes also owns a row of a dense [2, kv_heads, slots, capacity, head_dim] tensor per layer: its
K/V are copied in once, when it starts decoding, then each step appends one token, and attention
reads the rows in place as a strided view (no gather). A 1-token step is the only kind served
this way; prefill chunks and speculative verification keep the paged path.

The pool stays the source of truth (prefix caching, preemption, prefill): every token is still
written there too, and a row is simply dropped when its request stops running or is preempted.
Costs `max_num_seqs x longest context in flight` of extra K/V memory, grown on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .model import AttentionGroup, AttentionMetadata, KVCacheTensors, LlamaShape, build_attention_metadata
from .request import Request, RequestStatus


class DecodeSlots:
    def __init__(self, shape: LlamaShape, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, initial_capacity: int = 256):
        self.shape, self.num_slots, self.max_len = shape, num_slots, max_len
        self.dtype, self.device = dtype, device
        self.initial_capacity = initial_capacity
        self.capacity = 0
        self.kv: list[torch.Tensor] = []  # per layer [2, kv_heads, slots, capacity, head_dim]
        self.owner: list[tuple[Request, int] | None] = [None] * num_slots  # (request, its preemption count)
        self.slot_of: dict[str, int] = {}

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    def ensure_capacity(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        if tokens > self.max_len:
            raise ValueError(f"context of {tokens} tokens exceeds max_model_len {self.max_len}")
        cap = max(self.initial_capacity, self.capacity)
        while cap < tokens:
            cap *= 2
        cap = min(cap, self.max_len)
        s = self.shape
        new = [torch.zeros(2, s.num_kv_heads, self.num_slots, cap, s.head_dim, dtype=self.dtype, device=self.device)
               for _ in range(s.num_layers)]
        for old, n in zip(self.kv, new):
            n[..., : self.capacity, :] = old
        self.kv, self.capacity = new, cap

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.owner[slot] = None

    def release_stale(self) -> None:
        """Drop the rows of requests that finished, were aborted or were preempted since."""
        for rid, slot in list(self.slot_of.items()):
            req, npre = self.owner[slot]  # type: ignore[misc]
            if req.status is not RequestStatus.RUNNING or req.num_preemptions != npre:
                self.release(rid)

    def assign(self, req: Request, cache: KVCacheTensors, block_ids: list[int], context: int) -> int | None:
        """A free row for `req`, filled with the K/V of its first `context` tokens from the pool
        (None when every row is taken: the request then stays on the paged path)."""
        if len(self.slot_of) >= self.num_slots:
            return None
        slot = self.owner.index(None)  # lowest free: keeps the used rows one contiguous run
        self.ensure_capacity(context + 1)
        if context:
            nb = -(-context // cache.block_size)
            bt = torch.tensor([block_ids[:nb]], dtype=torch.long, device=self.device)
            for li, kv in enumerate(self.kv):
                k, v = cache.gather(li, bt)  # [kv_heads, 1, nb*block_size, d]
                kv[0, :, slot, :context] = k[:, 0, :context]
                kv[1, :, slot, :context] = v[:, 0, :context]
        self.owner[slot] = (req, req.num_preemptions)
        self.slot_of[req.request_id] = slot
        return slot


@dataclass
class DenseStep:
    """This step's decode rows [row0, row0 + n) of the flat batch, their slots and positions."""

    slots: DecodeSlots
    lo: int  # first slot of the attended run
    hi: int  # one past its last
    context: int  # keys attended: the longest context among the rows
    row0: int
    dest: torch.Tensor  # [n] slot * capacity + position: where each row's K/V go

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kv = self.slots.kv[layer]
        two, kvh, S, cap, d = kv.shape
        x = torch.stack((k[self.row0:], v[self.row0:])).transpose(1, 2)  # [2, kvh, n, d]
        kv.view(two, kvh, S * cap, d).index_copy_(2, self.dest, x)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.slots.kv[layer]
        return kv[0, :, self.lo:self.hi, : self.context], kv[1, :, self.lo:self.hi, : self.context]


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def run_with_slots(
    model,
    cache: KVCacheTensors,
    slots: DecodeSlots,
    seqs: list[tuple[list[int], int, list[int]]],
    rows: list[list[int]],
    slot_ids: list[int | None],
    short_query: int = 16,
) -> torch.Tensor:
    """`run_paged` (model.py) where the sequences with a slot (1-token decodes) attend over their
    slot rows: the paged sequences come first in the flat batch, then the slotted ones in slot
    order, as one attention group over the run of slots they span. Returns logits in the order of
    `seqs` and `rows`, like run_paged."""
    n = len(seqs)
    dev = model.device
    paged = [i for i in range(n) if slot_ids[i] is None]
    dense = sorted((i for i in range(n) if slot_ids[i] is not None), key=lambda i: slot_ids[i])
    key = lambda i: (len(seqs[i][2]) > short_query, seqs[i][1] + len(seqs[i][2]))  # noqa: E731
    order = sorted(paged, key=key)
    base = [0] * n
    ids: list[int] = []
    for i in order:
        base[i] = len(ids)
        ids.extend(seqs[i][2])
    row0 = len(ids)
    for i in dense:
        base[i] = len(ids)
        ids.extend(seqs[i][2])
    index = [base[i] + r for i in range(n) for r in rows[i]]
    group = model.shape.num_heads // model.shape.num_kv_heads
    if order:
        meta = build_attention_metadata([(seqs[i][0], seqs[i][1], len(seqs[i][2])) for i in order], cache.block_size,
                                        dev, query_group=group, short_query=short_query)
    else:
        empty = torch.empty(0, dtype=torch.long, device=dev)
        meta = AttentionMetadata(empty, empty, [])
    if dense:
        bs = cache.block_size
        sl = np.fromiter((slot_ids[i] for i in dense), dtype=np.int64, count=len(dense))
        pos = np.fromiter((seqs[i][1] for i in dense), dtype=np.int64, count=len(dense))
        blk = np.fromiter((seqs[i][0][p // bs] for i, p in zip(dense, pos.tolist())), dtype=np.int64, count=len(dense))
        ctx = int(pos.max()) + 1
        slots.ensure_capacity(ctx)
        lo, hi = int(sl[0]), int(sl[-1]) + 1
        S = hi - lo
        token_index = np.full(S, row0, dtype=np.int64)
        valid = np.zeros(S, dtype=bool)
        qpos = np.zeros(S, dtype=np.int64)  # a free slot in the run is a dummy row seeing key 0, discarded
        token_index[sl - lo] = row0 + np.arange(len(dense))
        valid[sl - lo] = True
        qpos[sl - lo] = pos
        # additive, built once for all layers (a boolean mask is converted by every SDPA call)
        hidden = _to(np.arange(ctx)[None, :] > qpos[:, None], dev)
        mask = torch.zeros(S, ctx, dtype=model.dtype, device=dev).masked_fill_(hidden, float("-inf"))
        mask = mask[None, :, None, :].expand(1, S, group, ctx)
        step = DenseStep(slots, lo, hi, ctx, row0, _to(sl * slots.capacity + pos, dev))
        flat_rows = token_index[valid]
        row_range = (row0, row0 + S) if S == len(dense) else None
        meta.groups.append(AttentionGroup(_to(token_index[:, None], dev), _to(valid[:, None], dev), _to(flat_rows, dev),
                                          None, mask, row_range, dense=step))  # type: ignore[arg-type]
        meta.slot_mapping = torch.cat((meta.slot_mapping, _to(blk * bs + pos % bs, dev)))
        meta.positions = torch.cat((meta.positions, _to(pos, dev)))
        meta.dense = step
    return model.forward(
        torch.tensor(ids, dtype=torch.long, device=dev),
        meta,
        cache,
        torch.tensor(index, dtype=torch.long, device=dev),
    )
