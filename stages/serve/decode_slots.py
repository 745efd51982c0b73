"""Contiguous K/V of decoding requests, one row ("slot") per request, kept next to the paged pool.

A decode step's attention reads every running request's whole context. Read from the paged pool,
that means gathering each request's blocks into a padded copy for every layer of every step; on
CPU that copy (and reading it back) is the step's largest memory traffic. Here a request that
decodes also owns a row of a dense [2, kv_heads, slots, capacity, head_dim] tensor per layer: its
K/V are copied in once, when it starts decoding, then each step appends one token, and attention
reads the rows in place as a strided view (no gather). A 1-token decode is served this way, and
so is a decode that verifies k draft tokens (k+1 query rows, causal among themselves; the K/V of
rejected drafts land past the accepted ones and are overwritten before anything reads them);
prefill chunks keep the paged path. Rows freed in the middle are filled at once by moving the
highest rows down (`compact`), so attention never spans free rows. Float32 rows on CPU are read by
slot_kernel.py's kernel, each query over exactly the keys it sees; other rows by one padded SDPA call.

The pool stays the source of truth (prefix caching, preemption, prefill): every token is still
written there too, and a row is simply dropped when its request stops running or is preempted.
Costs `max_num_seqs x longest context in flight` of extra K/V memory, grown on demand up to
`row_capacity` positions per row: the rows are paid for out of the KV budget (kv_budget.py), and a
request whose context would outgrow its row decodes from the pool instead (`fits`, runner.py).
"""

from __future__ import annotations

import numpy as np
import torch

from . import slot_kernel
from .attention import AttentionGroup, AttentionMetadata, SlotWrite, build_attention_metadata
from .lora import LoRAAdapter, LoRAStep
from .model import KVCacheTensors, LlamaShape
from .request import Request, RequestStatus


class DecodeSlots:
    INITIAL_CAPACITY = 256  # positions per row when first allocated; rows double from there

    def __init__(self, shape: LlamaShape, num_slots: int, row_capacity: int, dtype: torch.dtype,
                 device: torch.device, initial_capacity: int = INITIAL_CAPACITY):
        self.shape, self.num_slots, self.row_capacity = shape, num_slots, row_capacity
        self.dtype, self.device = dtype, device
        self.initial_capacity = initial_capacity
        self.capacity = 0
        self.kv: list[torch.Tensor] = []  # per layer [2, kv_heads, slots, capacity, head_dim]
        self.owner: list[tuple[Request, int] | None] = [None] * num_slots  # (request, its preemption count)
        self.slot_of: dict[str, int] = {}
        self.num_moves = 0  # rows moved down into holes (compact)

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self.kv)

    def fits(self, tokens: int) -> bool:
        """Whether a row can hold a context of `tokens` positions (with the one spare ensure_capacity keeps)."""
        return tokens + 1 <= self.row_capacity

    def ensure_capacity(self, tokens: int) -> None:
        """Room for `tokens` positions, and always one more; and one row more than there are slots.
        The rows and context attended are then never the whole tensor, which would make the view
        contiguous: the compiled decode step (compiled_forward.py) would specialise on it, and the
        batch that fills every slot (reached under load, not at warm-up) would compile on the
        request path (measured: 30 s at concurrency 128 with max_num_seqs 128)."""
        tokens += 1
        if tokens <= self.capacity:
            return
        if tokens > self.row_capacity:
            raise ValueError(f"context of {tokens - 1} tokens does not fit a decode-slot row of "
                             f"{self.row_capacity} positions (callers check `fits` first)")
        cap = max(self.initial_capacity, self.capacity)
        while cap < tokens:
            cap *= 2
        cap = min(cap, self.row_capacity)
        s = self.shape
        # layer by layer, each old copy dropped before the next layer's new one is made: the rows
        # never hold more than their new size plus one layer's old copy (what kv_budget reserves)
        first = not self.kv
        for i in range(s.num_layers):
            new = torch.zeros(2, s.num_kv_heads, self.num_slots + 1, cap, s.head_dim, dtype=self.dtype, device=self.device)
            if first:
                self.kv.append(new)
            else:
                new[..., : self.capacity, :] = self.kv[i]
                self.kv[i] = new
            del new
        self.capacity = cap

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.owner[slot] = None

    def release_stale(self) -> None:
        """Drop the rows of requests that finished, were aborted or were preempted since, then
        close the holes they leave (called before a step looks any slot up)."""
        for rid, slot in list(self.slot_of.items()):
            req, npre = self.owner[slot]  # type: ignore[misc]
            if req.status is not RequestStatus.RUNNING or req.num_preemptions != npre:
                self.release(rid)
        self.compact()

    def compact(self) -> None:
        """Move the highest used rows into the free rows below them, so that the used rows are
        0..n-1. Decode attention runs over the span of used rows, free ones included: a hole costs
        a whole padded row of attention every step and layer (and as requests drain at the end of
        a burst, most of the span would be holes), while a move copies one row's K/V once."""
        n = len(self.slot_of)
        holes = [i for i in range(n) if self.owner[i] is None]
        if not holes:
            return
        movers = [i for i in range(len(self.owner) - 1, n - 1, -1) if self.owner[i] is not None]
        length = 0
        for dst, src in zip(holes, movers):
            req, _ = self.owner[src]  # type: ignore[misc]
            self.owner[dst], self.owner[src] = self.owner[src], None
            self.slot_of[req.request_id] = dst
            self.num_moves += 1
            length = max(length, req.num_computed_tokens)  # the K/V a row holds: positions before this
        if length:
            dst_i = torch.tensor(holes[: len(movers)], device=self.device)
            src_i = torch.tensor(movers[: len(holes)], device=self.device)
            for kv in self.kv:
                kv[:, :, dst_i, :length] = kv[:, :, src_i, :length]

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


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _within(lens: np.ndarray) -> np.ndarray:
    """0, 1, .. within each of consecutive runs of these lengths: [2, 3] -> [0, 1, 0, 1, 2]."""
    ends = np.cumsum(lens)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - lens, lens)


def _causal_mask(qpos: np.ndarray, ctx: int) -> np.ndarray:
    """Additive [..., ctx] mask of queries at positions `qpos` over keys 0..ctx-1 (built once for all
    layers: a boolean mask is converted by every SDPA call)."""
    return np.where(np.arange(ctx) > qpos[..., None], np.float32(-np.inf), np.float32(0.0))


def _slot_group(slots: DecodeSlots, qpos: np.ndarray, ctx: int, lo: int, num_rows: int, group: int,
                dtype: torch.dtype, dev: torch.device) -> AttentionGroup:
    """The group over the slots lo.. whose queries sit at `qpos` [S, Q]. Where the slot kernel reads
    these slots (slot_kernel.py; two sequences or more) it gets each query's key count, and the mask
    only carries the group's sizes [1, S, Q*group, ctx] (zero strides, never read); otherwise the
    mask SDPA needs."""
    S, Q = qpos.shape
    # a lone sequence stays on SDPA: its one (head, sequence) pair leaves the kernel nothing to save
    # over the custom op's call (measured: a lone decode step 10 us slower through the kernel)
    if S > 1 and slot_kernel.usable(slots.kv):
        mask = torch.zeros((), dtype=dtype, device=dev).expand(1, S, Q * group, ctx)
        return AttentionGroup(mask, num_rows, slot_kv=slots.kv, slot_lo=lo, key_lengths=_to(qpos + 1, dev))
    if Q == 1:  # one query per sequence: its heads share one mask row
        mask = _to(_causal_mask(qpos[:, 0], ctx), dev).to(dtype)[None, :, None, :].expand(1, S, group, ctx)
    else:  # rows of the SDPA call are (query, head-in-group) pairs: [1, S, Q*group, ctx]
        mask = _to(np.repeat(_causal_mask(qpos, ctx), group, axis=1), dev).to(dtype)[None]
    return AttentionGroup(mask, num_rows, slot_kv=slots.kv, slot_lo=lo)


def prompt_group(lens: np.ndarray, n_decode: int, group: int, dtype: torch.dtype,
                 dev: torch.device) -> tuple[np.ndarray, AttentionGroup, np.ndarray]:
    """Whole prompts of these lengths after `n_decode` decode rows (run_decodes), attending among
    themselves over this step's own K/V: each prompt token's position, their attention group (one
    "sequence" of all the prompt rows, causal within a prompt, blocked across prompts) and the rows
    whose logits are wanted (every decode, then each prompt's last token)."""
    pos = _within(lens)
    doc = np.repeat(np.arange(len(lens)), lens)
    visible = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    mask = np.where(visible, np.float32(0.0), np.float32(-np.inf))
    # rows are (query, head-in-group) pairs, as in every group: [1, 1, P*group, P]
    mask = _to(np.repeat(mask, group, axis=0), dev).to(dtype)[None, None]
    rows = np.concatenate((np.arange(n_decode), n_decode + np.cumsum(lens) - 1))
    return pos, AttentionGroup(mask, int(lens.sum())), rows


def dense_group(slots: DecodeSlots, sl: np.ndarray, pos: np.ndarray, row0: int, group: int,
                dtype: torch.dtype, dev: torch.device,
                nq: np.ndarray | None = None) -> tuple[AttentionGroup, SlotWrite]:
    """The attention group of the decodes at flat rows row0.., in slot order `sl`: sequence i
    feeds `nq[i]` tokens (default 1; 1 + its draft tokens when verifying a speculation) from
    position `pos[i]`, its rows consecutive. One call over the run of slots they span, read in place
    (the slot kernel, or a padded SDPA call); and where each row's K/V go in the slots."""
    n = len(sl)
    lo, hi = int(sl[0]), int(sl[-1]) + 1
    S = hi - lo
    if nq is None:
        ctx = int(pos.max()) + 1
        slots.ensure_capacity(ctx)
        qpos = np.zeros(S, dtype=np.int64)  # a free slot in the run is a dummy row seeing key 0, discarded
        qpos[sl - lo] = pos
        g = _slot_group(slots, qpos[:, None], ctx, lo, n, group, dtype, dev)
        if S != n:  # free slots inside the run: the queries are padded to it
            token_index = np.full(S, row0, dtype=np.int64)
            valid = np.zeros(S, dtype=bool)
            token_index[sl - lo] = row0 + np.arange(n)
            valid[sl - lo] = True
            g.token_index, g.valid = _to(token_index[:, None], dev), _to(valid[:, None], dev)
        return g, SlotWrite(slots.kv, _to(sl * slots.capacity + pos, dev), row0)
    qmax = int(nq.max())
    ctx = int((pos + nq).max())
    slots.ensure_capacity(ctx)
    q_ar = np.arange(qmax)
    if S == n and bool((nq == qmax).all()):  # no hole, every sequence verifies as many drafts
        qpos = pos[:, None] + q_ar  # [n, qmax]: query j sits at pos + j and sees keys 0..pos+j (causal)
        return (_slot_group(slots, qpos, ctx, lo, n * qmax, group, dtype, dev),
                SlotWrite(slots.kv, _to((sl[:, None] * slots.capacity + qpos).ravel(), dev), row0))
    within = np.minimum(q_ar[None, :], nq[:, None] - 1)  # [n, qmax]; padding repeats the last query
    first = row0 + np.cumsum(nq) - nq  # flat row of each sequence's first token
    token_index = np.full((S, qmax), row0, dtype=np.int64)
    valid = np.zeros((S, qmax), dtype=bool)
    qpos = np.zeros((S, qmax), dtype=np.int64)
    token_index[sl - lo] = first[:, None] + within
    valid[sl - lo] = q_ar[None, :] < nq[:, None]
    qpos[sl - lo] = pos[:, None] + within
    row_pos = np.repeat(pos, nq) + _within(nq)
    g = _slot_group(slots, qpos, ctx, lo, int(nq.sum()), group, dtype, dev)
    g.token_index, g.valid = _to(token_index, dev), _to(valid, dev)
    return g, SlotWrite(slots.kv, _to(np.repeat(sl, nq) * slots.capacity + row_pos, dev), row0)


def run_decodes(model, cache: KVCacheTensors, slots: DecodeSlots, sl: np.ndarray, pos: np.ndarray,
                blk: np.ndarray, tokens: list[int], nq: np.ndarray | None = None,
                prompts: list[tuple[list[int], list[int]]] | None = None,
                adapters: list[LoRAAdapter | None] | None = None) -> torch.Tensor:
    """The all-decode step: every sequence in a decode slot, given in slot order (`sl` ascending),
    feeding `nq[i]` tokens (default one each; more with draft tokens to verify) from position
    `pos[i]`. `tokens`, and `blk` (the pool block of each token's position), are per token, the
    sequences' rows consecutive. Returns logits for every token, in the same order: no planning,
    no per-row index.

    `prompts` (compiled models, one token per decode): whole prompts, each (token ids, block ids),
    prefilled in the same forward after the decodes (requests joining a running batch). Logits are
    then of the decodes and of each prompt's last token, in that order.

    `adapters`: the LoRA adapter (or None) of each decode, then of each prompt."""
    dev = model.device
    lora = None
    if adapters is not None:
        lens = [1] * len(sl) if nq is None else nq.tolist()
        lens += [len(ids) for ids, _ in prompts or []]
        lora = LoRAStep.from_runs(zip(adapters, lens), dev)
    group = model.shape.num_heads // model.shape.num_kv_heads
    g, write = dense_group(slots, sl, pos, 0, group, model.dtype, dev, nq)
    bs = cache.block_size
    row_pos = pos if nq is None else np.repeat(pos, nq) + _within(nq)
    slot_mapping, positions, groups, logits_rows = blk * bs + row_pos % bs, row_pos, [g], None
    if prompts:
        lens = np.fromiter((len(ids) for ids, _ in prompts), dtype=np.int64, count=len(prompts))
        p_pos, p_group, rows = prompt_group(lens, len(tokens), group, model.dtype, dev)
        p_blk = np.concatenate([np.asarray(blocks, dtype=np.int64)[np.arange(len(ids)) // bs] for ids, blocks in prompts])
        slot_mapping = np.concatenate((slot_mapping, p_blk * bs + p_pos % bs))
        positions = np.concatenate((row_pos, p_pos))
        groups.append(p_group)
        tokens = tokens + [t for p, _ in prompts for t in p]
        logits_rows = _to(rows, dev)
    meta = AttentionMetadata(_to(slot_mapping, dev), _to(positions, dev), groups, write)
    return model.forward(torch.tensor(tokens, dtype=torch.long, device=dev), meta, cache, logits_rows, lora)


def run_with_slots(
    model,
    cache: KVCacheTensors,
    slots: DecodeSlots,
    seqs: list[tuple[list[int], int, list[int]]],
    rows: list[list[int]],
    slot_ids: list[int | None],
    short_query: int = 16,
    adapters: list[LoRAAdapter | None] | None = None,
) -> torch.Tensor:
    """`run_paged` (model.py) where the sequences with a slot (decodes, with or without draft tokens
    to verify) attend over their slot rows: the paged sequences come first in the flat batch, then
    the slotted ones in slot order, as one attention group over the run of slots they span. Returns logits in the order of
    `seqs` and `rows`, like run_paged; `adapters` as run_paged's."""
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
        nq = np.fromiter((len(seqs[i][2]) for i in dense), dtype=np.int64, count=len(dense))
        multi = bool((nq > 1).any())
        g, write = dense_group(slots, sl, pos, row0, group, model.dtype, dev, nq if multi else None)
        row_pos = [p + j for i, p in zip(dense, pos.tolist()) for j in range(len(seqs[i][2]))] if multi else pos.tolist()
        row_seq = [i for i in dense for _ in seqs[i][2]] if multi else dense
        blk = np.fromiter((seqs[i][0][p // bs] for i, p in zip(row_seq, row_pos)), dtype=np.int64, count=len(row_pos))
        row_pos = np.asarray(row_pos, dtype=np.int64)
        meta.groups.append(g)
        meta.slot_mapping = torch.cat((meta.slot_mapping, _to(blk * bs + row_pos % bs, dev)))
        meta.positions = torch.cat((meta.positions, _to(row_pos, dev)))
        meta.slot_write = write
    lora = None if adapters is None else \
        LoRAStep.from_runs(((adapters[i], len(seqs[i][2])) for i in order + dense), dev)
    return model.forward(
        torch.tensor(ids, dtype=torch.long, device=dev),
        meta,
        cache,
        torch.tensor(index, dtype=torch.long, device=dev),
        lora,
    )
