"""attention.attend over every kind of group a step makes (paged, padded and not; decode slots read
in place, with a free slot in the run; whole prompts over their own K/V) against attention computed
one query at a time from each sequence's whole K/V history. Float64, so the bound is rounding only."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from stages.serve.attention import AttentionMetadata, attend, build_attention_metadata
from stages.serve.decode_slots import DecodeSlots, dense_group, prompt_group
from stages.serve.model import KVCacheTensors

KVH, GROUP, D, BS = 2, 3, 8, 4
DT, DEV = torch.float64, torch.device("cpu")
SHAPE = SimpleNamespace(num_kv_heads=KVH, head_dim=D, num_layers=1)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """q [heads, d] at position `pos` over k, v [kv_heads, >pos, d]: softmax(q k^T / sqrt(d)) v, causal;
    query head h reads kv head h // GROUP (HF's repeat_kv)."""
    out = []
    for h in range(KVH * GROUP):
        kk, vv = k[h // GROUP, : pos + 1], v[h // GROUP, : pos + 1]
        w = torch.softmax(kk @ q[h] / D ** 0.5, dim=0)
        out.append(w @ vv)
    return torch.stack(out)


def test_attend_equals_per_query_attention_over_each_sequences_history():
    g = torch.Generator().manual_seed(0)
    cache = KVCacheTensors(SHAPE, 64, BS, DT, DEV)
    slots = DecodeSlots(SHAPE, 4, 64, DT, DEV, initial_capacity=8)
    # paged: (blocks, start, new tokens); A and B share a padded group, C (> 16 new) has its own;
    # D and E decode in slots 0 and 2, slot 1 free: their group is padded over the run 0..2
    paged = [([1, 2, 3], 5, 3), ([4], 0, 1), ([5, 6, 7, 8, 9, 10], 2, 20)]
    slotted = [([11, 12, 13], 9, 0), ([14, 15], 6, 2)]  # (blocks, start, slot)
    history = {}
    for i, (blocks, start, _) in enumerate(paged + slotted):
        history[i] = torch.randn(2, KVH, start, D, generator=g, dtype=DT)
        where = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(start)], dtype=torch.long)
        cache.write_stacked(0, where, history[i])
    slots.ensure_capacity(16)
    for i, (_, start, slot) in enumerate(slotted, len(paged)):
        slots.kv[0][:, :, slot, :start] = history[i]

    meta = build_attention_metadata(paged, BS, DEV, query_group=GROUP)
    assert [gr.token_index is not None for gr in meta.groups] == [True, False]  # padded, then in place
    row0 = sum(q for _, _, q in paged)
    sl, pos = np.array([s for _, _, s in slotted]), np.array([st for _, st, _ in slotted])
    group, write = dense_group(slots, sl, pos, row0, GROUP, DT, DEV)
    assert group.token_index is not None  # the free slot 1 pads the run
    meta = AttentionMetadata(
        torch.cat((meta.slot_mapping, torch.tensor([b[st // BS] * BS + st % BS for b, st, _ in slotted]))),
        torch.cat((meta.positions, torch.from_numpy(pos))), meta.groups + [group], write)

    T = row0 + len(slotted)
    q = torch.randn(T, KVH * GROUP, D, generator=g, dtype=DT)
    kv_new = torch.randn(2, KVH, T, D, generator=g, dtype=DT)
    cache.write_stacked(0, meta.slot_mapping, kv_new)  # as LayerPass.run: write first, then attend
    write.write(0, kv_new)
    got = attend(0, q, kv_new, meta.groups, cache)

    row = 0
    for i, (_, start, n) in enumerate(paged + [(b, st, 1) for b, st, _ in slotted]):
        k, v = torch.cat((history[i], kv_new[:, :, row:row + n]), dim=2)
        for j in range(n):
            torch.testing.assert_close(got[row + j], reference(q[row + j], k, v, start + j), rtol=0, atol=1e-12)
        row += n


def test_whole_prompts_attend_among_themselves_beside_decodes_in_slots():
    g = torch.Generator().manual_seed(1)
    cache = KVCacheTensors(SHAPE, 16, BS, DT, DEV)
    slots = DecodeSlots(SHAPE, 2, 64, DT, DEV, initial_capacity=8)
    starts = [3, 5]
    slots.ensure_capacity(8)
    history = [torch.randn(2, KVH, s, D, generator=g, dtype=DT) for s in starts]
    for slot, h in enumerate(history):
        slots.kv[0][:, :, slot, : h.shape[2]] = h
    decodes, write = dense_group(slots, np.arange(2), np.array(starts), 0, GROUP, DT, DEV)
    lens = np.array([3, 2])
    p_pos, prompts, logits_rows = prompt_group(lens, 2, GROUP, DT, DEV)
    assert decodes.token_index is None and prompts.token_index is None
    assert p_pos.tolist() == [0, 1, 2, 0, 1] and logits_rows.tolist() == [0, 1, 4, 6]
    T = 2 + int(lens.sum())
    meta = AttentionMetadata(torch.arange(T), torch.zeros(T, dtype=torch.long), [decodes, prompts], write)
    assert meta.prompts_join
    q = torch.randn(T, KVH * GROUP, D, generator=g, dtype=DT)
    kv_new = torch.randn(2, KVH, T, D, generator=g, dtype=DT)
    write.write(0, kv_new)
    got = attend(0, q, kv_new, meta.groups, cache)

    for r, s in enumerate(starts):
        k, v = torch.cat((history[r], kv_new[:, :, r:r + 1]), dim=2)
        torch.testing.assert_close(got[r], reference(q[r], k, v, s), rtol=0, atol=1e-12)
    row = 2
    for n in lens.tolist():  # each prompt sees only its own earlier tokens
        k, v = kv_new[:, :, row:row + n].unbind(0)
        for j in range(n):
            torch.testing.assert_close(got[row + j], reference(q[row + j], k, v, j), rtol=0, atol=1e-12)
        row += n
