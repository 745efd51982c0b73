"""A step's attention: which sequences attend together, where their keys and values come from, and
the one function (`attend`) that the layer loop (layer_pass.py) calls for all of them.

The flat batch of a step is cut into groups of consecutive rows; each group is one padded SDPA call
over [kv_heads, S sequences, K keys, head_dim], its K/V taken from one of three places:
- the paged pool, gathered through the group's block tables (PagedAttention's indirection, done
  with a gather and SDPA, which runs on CPU and CUDA alike): prefill chunks, and decodes without a
  decode slot;
- decode slots (decode_slots.py), read in place as a strided view: decodes, with or without draft
  tokens to verify (float32 on CPU: by slot_kernel.py's kernel, each query over exactly its keys);
- the step's own new K/V: whole prompts that join a decoding batch and start at position 0 attend
  only among themselves.
Because groups are runs of consecutive rows in order, the attention output is the groups' outputs
one after the other: no scatter, and a group whose queries fill its [S, Q] grid (no padding) reads
its rows as a view. Sizes (sequences, queries, keys, rows) are read off tensor shapes rather than
kept as Python ints, so that they stay symbolic when the pass is compiled and one graph serves every
batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .slot_kernel import slot_attention


@dataclass
class AttentionGroup:
    """Consecutive sequences of the flat batch attended together in one padded SDPA call."""

    # [1, S, Q*group, K], bool or additive: key k visible to query row (query, head-in-group); its
    # sizes are the group's sequences S, queries per sequence Q and keys K (with key_lengths, the
    # sizes alone: zero strides, never read)
    mask: torch.Tensor
    num_rows: int  # rows of the flat batch the group covers (S*Q when none is padding)
    # padded groups only (None: the rows fill the [S, Q] grid in order and are read as a view)
    token_index: torch.Tensor | None = None  # [S, Q] rows of the flat batch (padding repeats a valid row)
    valid: torch.Tensor | None = None  # [S, Q] bool: real query rows
    # where K/V come from: the pool through block tables, decode-slot rows lo.. in place, or (both
    # None) the group's own rows of this step's new K/V (whole prompts from position 0)
    block_tables: torch.Tensor | None = None  # [S, Bmax] block ids (padding: 0, masked out)
    slot_kv: list[torch.Tensor] | None = None  # per layer [2, kv_heads, slots, capacity, head_dim]
    slot_lo: int = 0  # the first decode slot of the group's run of S slots
    # decode slots on CPU (slot_kernel.py): [S, Q] keys each query sees; attention then reads exactly
    # those, not the mask's padded K
    key_lengths: torch.Tensor | None = None


@dataclass
class SlotWrite:
    """This step's decode rows [row0, row0 + len(dest)) also go to their decode slots."""

    slot_kv: list[torch.Tensor]  # per layer [2, kv_heads, slots, capacity, head_dim]
    dest: torch.Tensor  # [n] slot * capacity + position of each row
    row0: int

    def write(self, layer: int, kv_new: torch.Tensor) -> None:
        """kv_new: the step's K and V, [2, kv_heads, T, head_dim]."""
        kv = self.slot_kv[layer]
        two, kvh, S, cap, d = kv.shape
        rows = kv_new[:, :, self.row0:self.row0 + self.dest.shape[0]]
        kv.view(two, kvh, S * cap, d).index_copy_(2, self.dest, rows)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot (block_id * block_size + offset) of each token
    positions: torch.Tensor  # [T] position of each token in its sequence
    groups: list[AttentionGroup]  # in flat-batch order, together covering every row once
    slot_write: SlotWrite | None = None

    @property
    def prompts_join(self) -> bool:
        """Whole prompts attend among themselves beside the decodes (decode_slots.run_decodes)."""
        return any(g.block_tables is None and g.slot_kv is None for g in self.groups)


def group_keys_values(g: AttentionGroup, layer: int, cache, kv_new: torch.Tensor,
                      rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's K and V as [kv_heads, S, K, head_dim]."""
    if g.slot_kv is not None:  # in place: a strided view of the run of slots, no copy
        kv, S, K = g.slot_kv[layer], g.mask.shape[1], g.mask.shape[3]
        return kv[0, :, g.slot_lo:g.slot_lo + S, :K], kv[1, :, g.slot_lo:g.slot_lo + S, :K]
    if g.block_tables is not None:
        return cache.gather(layer, g.block_tables)
    own = kv_new[:, :, rows].unsqueeze(2)  # one "sequence" of all the prompts' rows; the mask parts them
    return own[0], own[1]


def attend(layer: int, q: torch.Tensor, kv_new: torch.Tensor, groups: list[AttentionGroup], cache) -> torch.Tensor:
    """q [T, heads, d] and this step's K/V [2, kv_heads, T, d] (already written to the cache and the
    slots: every sequence sees this step's K/V of its own earlier tokens) -> attention [T, heads, d]."""
    _, nh, d = q.shape
    kvh = kv_new.shape[1]
    group = nh // kvh
    outs, start = [], 0
    for g in groups:
        S, QG = g.mask.shape[1], g.mask.shape[2]
        Q = QG // group
        # a size, not g.num_rows, for unpadded groups: it stays symbolic when compiled
        n = S * Q if g.token_index is None else g.num_rows
        rows = slice(start, start + n)
        # GQA without repeating K/V: the `group` query heads sharing a KV head become extra
        # query rows of that head, [kvh, S, Q*group, d] (HF's repeat_kv: head h uses kv h // group)
        qq = q[rows].reshape(S, Q, kvh, group, d) if g.token_index is None else \
            q[g.token_index].view(S, Q, kvh, group, d)
        qq = qq.permute(2, 0, 1, 3, 4).reshape(kvh, S, QG, d)
        if g.key_lengths is not None:
            o = slot_attention(qq, g.slot_kv[layer], g.slot_lo, g.key_lengths, group, 1.0 / math.sqrt(d))
        else:
            kk, vv = group_keys_values(g, layer, cache, kv_new, rows)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, scale=1.0 / math.sqrt(d))
        o = o.view(kvh, S, Q, group, d).permute(1, 2, 0, 3, 4)
        outs.append(o.reshape(n, nh, d) if g.token_index is None else o.reshape(S, Q, nh, d)[g.valid])
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def build_attention_metadata(
    seqs: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
    query_group: int = 1,
    short_query: int = 16,
    group_size: int = 16,
) -> AttentionMetadata:
    """`seqs`: per sequence (block ids, start position, number of new tokens), in flat-batch order.

    Runs of up to `group_size` consecutive sequences with at most `short_query` new tokens (decodes,
    verifications, short chunks) share one padded SDPA call; longer prefill chunks get one call
    each, so a long prompt does not pad the rest. Each group pads its K/V to its own longest context,
    so callers that order short queries by context length (run_paged) gather the fewest bytes.
    Built with a handful of vectorised ops: this runs every step, for every request."""
    # numpy, not torch: these are tiny integer arrays and numpy's per-op cost is a tenth of torch's
    n = len(seqs)
    lens = np.fromiter((q for _, _, q in seqs), dtype=np.int64, count=n)
    starts = np.fromiter((st for _, st, _ in seqs), dtype=np.int64, count=n)
    nblocks = -(-(starts + lens) // block_size)
    bmax = int(nblocks.max())
    bt = np.zeros((n, bmax), dtype=np.int64)
    for i, ((b, _, _), nb) in enumerate(zip(seqs, nblocks.tolist())):
        bt[i, :nb] = b[:nb]
    offsets = np.cumsum(lens) - lens
    seq_of = np.repeat(np.arange(n), lens)
    positions = starts[seq_of] + np.arange(int(lens.sum())) - offsets[seq_of]
    slots = bt[seq_of, positions // block_size] * block_size + positions % block_size

    parts: list[list[int]] = []
    for i, q in enumerate(lens.tolist()):
        if q > short_query or not parts or len(parts[-1]) == group_size or lens[parts[-1][0]] > short_query:
            parts.append([i])
        else:
            parts[-1].append(i)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    groups = []
    for idx in parts:
        sel = np.asarray(idx)
        g_lens, g_starts, g_off = lens[sel], starts[sel], offsets[sel]
        qmax = int(g_lens.max())
        g_bmax = int(nblocks[sel].max())
        q_ar = np.arange(qmax)
        within = np.minimum(q_ar[None, :], g_lens[:, None] - 1)
        # query i of a sequence sits at position start + i and sees keys 0..start+i (causal)
        qpos = g_starts[:, None] + within
        mask = np.arange(g_bmax * block_size)[None, None, :] <= qpos[:, :, None]  # [S, Q, K]
        # rows are (query, head-in-group) pairs, batched over (kv head, sequence): [1, S, Q*group, K]
        mask = np.repeat(mask, query_group, axis=1)[None]
        g = AttentionGroup(t(mask), int(g_lens.sum()), block_tables=t(bt[sel, :g_bmax]))
        if not (g_lens == qmax).all():  # padded: queries gathered, outputs picked
            g.token_index, g.valid = t(g_off[:, None] + within), t(q_ar[None, :] < g_lens[:, None])
        groups.append(g)
    slots, positions = torch.from_numpy(slots), torch.from_numpy(positions)
    return AttentionMetadata(slots.to(device), positions.to(device), groups)
