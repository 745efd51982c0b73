"""The decode-slot attention kernel (slot_kernel.py) against SDPA over the same rows, and its fallbacks."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from stages.serve import slot_kernel


def _sdpa_reference(q, kv, lo, lengths, group):
    """SDPA over the slot rows lo.., each query masked to its first `lengths` keys."""
    H, S, R, D = q.shape
    K = int(lengths.max())
    visible = torch.arange(K)[None, None, :] < lengths[:, :, None]  # [S, Q, K]
    mask = visible.repeat_interleave(group, dim=1)[None]  # rows query-major: [1, S, Q*group, K]
    k, v = kv[0, :, lo:lo + S, :K], kv[1, :, lo:lo + S, :K]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / math.sqrt(D))


@pytest.mark.parametrize("head_dim", [32, 64, 16, 12])  # 12: not a multiple of 8, the plain C loops
# heads of one query go through in pairs (one pass over their keys): group 3 leaves one on its own
@pytest.mark.parametrize("kv_heads,group,queries", [(2, 2, 1), (1, 4, 1), (2, 1, 3), (2, 2, 6), (2, 3, 2)])
def test_kernel_equals_sdpa_over_the_keys_each_query_sees(head_dim, kv_heads, group, queries):
    if slot_kernel.kernel() is None:
        pytest.skip("no C compiler here: decode attention runs on SDPA")
    gen = torch.Generator().manual_seed(head_dim * 31 + kv_heads * 7 + group * 3 + queries)
    slots, cap, lo = 9, 80, 2
    for S in (1, 3, 7):
        kv = torch.randn(2, kv_heads, slots, cap, head_dim, generator=gen)
        start = torch.randint(0, cap - queries, (S,), generator=gen)
        lengths = start[:, None] + torch.arange(queries)[None, :] + 1  # query j of a sequence sees one key more
        q = torch.randn(kv_heads, S, queries * group, head_dim, generator=gen)
        got = slot_kernel.slot_attention(q, kv, lo, lengths, group, 1 / math.sqrt(head_dim))
        want = _sdpa_reference(q, kv, lo, lengths, group)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_runs_inside_a_compiled_graph_with_symbolic_sizes():
    if slot_kernel.kernel() is None:
        pytest.skip("no C compiler here: decode attention runs on SDPA")
    kv = torch.randn(2, 2, 12, 40, 32)

    def attend(q, kv, lengths):
        return torch.ops.eightfold.slot_attention(q * 1.0, kv, 0, lengths, 2, 0.5) + 1.0

    compiled = torch.compile(attend, dynamic=True)
    for S in (3, 5, 9):
        q = torch.randn(2, S, 2, 32)
        lengths = torch.randint(1, 40, (S, 1))
        torch.testing.assert_close(compiled(q, kv, lengths), attend(q, kv, lengths))


def test_without_a_compiler_decode_attention_falls_back_to_sdpa(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(slot_kernel, "_state", {})
    monkeypatch.setenv("EIGHTFOLD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=slot_kernel.__name__):
        assert slot_kernel.kernel() is None
    assert "no C compiler" in caplog.text
    assert not slot_kernel.usable([torch.zeros(2, 1, 2, 8, 32)])


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(slot_kernel, "_state", {})
    monkeypatch.setenv("EIGHTFOLD_SLOT_KERNEL", "0")
    assert slot_kernel.kernel() is None
    assert not slot_kernel.usable([torch.zeros(2, 1, 2, 8, 32)])


def test_only_float32_cpu_slots_with_dense_rows_use_it(monkeypatch):
    monkeypatch.setattr(slot_kernel, "_state", {"fn": object()})  # as if built
    assert slot_kernel.usable([torch.zeros(2, 1, 2, 8, 32)])
    assert not slot_kernel.usable([torch.zeros(2, 1, 2, 8, 32, dtype=torch.bfloat16)])
    assert not slot_kernel.usable([torch.zeros(2, 1, 2, 32, 8).transpose(3, 4)])
