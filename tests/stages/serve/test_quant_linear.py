"""Quantized weights kept packed: each dequantizes to exactly what an independent reader gives (the export
stage's reference INT4 unpacker; gguf's own numpy dequantizer for Q8_0 / Q4_0), F.linear / torch.cat /
row lookups through them equal the same ops on the dequantized tensor, and bad input is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stages.export.quantize import dequant_int4, int4_groupwise, pack_int4, unpack_int4
from stages.serve.quant_linear import GGUFBlockWeight, Int4GroupWeight, take_quantized, weight_bytes


def _int4(out_f=48, in_f=256, group=128, seed=0):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    q, s = int4_groupwise(w, group)
    return Int4GroupWeight(pack_int4(q), s, (out_f, in_f), torch.float32), dequant_int4(q, s)


def test_int4_dequantizes_like_the_reference_and_stays_packed():
    w, ref = _int4()
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(unpack_int4(w.packed, w.shape), torch.round(ref / w.scale.repeat_interleave(128, 1)).to(torch.int8))
    x = torch.randn(5, 256)
    assert torch.equal(F.linear(x, w), F.linear(x, ref))
    b = torch.randn(48)
    assert torch.allclose(F.linear(x, w, b), F.linear(x, ref, b))
    assert F.linear(x.bfloat16(), w).dtype == torch.bfloat16  # dequantized into the activation dtype
    # 4 bits per weight plus a float32 scale per 128: ~0.53 bytes per weight against 2 for bf16
    assert w.nbytes == 48 * 256 // 2 + 48 * 2 * 4
    assert weight_bytes([w, w, None]) == w.nbytes


def test_int4_fused_rows_and_lookup():
    a, ra = _int4(32, 256, seed=1)
    b, rb = _int4(16, 256, seed=2)
    fused = torch.cat([a, b])
    assert isinstance(fused, Int4GroupWeight) and fused.shape == (48, 256)
    assert torch.equal(fused.dequantize(), torch.cat([ra, rb]))
    ids = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(fused[ids], torch.cat([ra, rb])[ids])
    with pytest.raises(TypeError, match="dim 0"):
        torch.cat([a, b], dim=1)


def test_take_quantized_pulls_triples_and_names_missing_parts():
    w, ref = _int4()
    sd = {"x.weight_packed": w.packed, "x.weight_scale": w.scale, "x.weight_shape": torch.tensor([48, 256]),
          "y.weight": torch.ones(2)}
    got = take_quantized(sd, torch.bfloat16)
    assert set(sd) == {"y.weight"} and set(got) == {"x.weight"}
    assert torch.equal(got["x.weight"].dequantize(), ref.bfloat16())
    with pytest.raises(KeyError, match="weight_shape"):
        take_quantized({"x.weight_packed": w.packed, "x.weight_scale": w.scale}, torch.float32)
    with pytest.raises(ValueError, match="weight_packed must be int32"):
        Int4GroupWeight(w.packed[:, :3], w.scale, (48, 256), torch.float32)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_gguf_blocks_dequantize_like_gguf(kind):
    import gguf

    qt = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qt)  # [rows, blocks * bytes]: the rows as the file stores them
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(24, 96).astype(np.float32))
    bw = GGUFBlockWeight.from_raw(kind, torch.from_numpy(raw), (24, 96), torch.float32)
    assert torch.equal(bw.dequantize(), ref)
    assert bw.nbytes == raw.nbytes
    x = torch.randn(3, 96)
    assert torch.allclose(F.linear(x, bw), F.linear(x, ref), atol=1e-6)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    assert torch.equal(bw.permute_rows(order).dequantize(), ref[order])
    assert torch.equal(torch.cat([bw, bw]).dequantize(), torch.cat([ref, ref]))
    assert torch.equal(bw[torch.tensor([5, 1])], ref[[5, 1]])
    with pytest.raises(ValueError, match="whole blocks"):
        GGUFBlockWeight.from_raw(kind, torch.from_numpy(raw), (24, 100), torch.float32)


def test_int4_width_not_a_multiple_of_eight():
    """The last int32 word of a row is padded (pack_int4): the unpacker must drop the padding."""
    w = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    q, s = int4_groupwise(w, 10)
    packed = pack_int4(q)
    assert packed.shape == (3, 3)
    assert torch.equal(Int4GroupWeight(packed, s, (3, 20), torch.float32).dequantize(), dequant_int4(q, s))
