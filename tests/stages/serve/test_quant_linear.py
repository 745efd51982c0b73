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


def _w8a8(out_f=48, in_f=256, seed=0, int8_inputs=True):
    from stages.export.quantize import int8_per_channel
    from stages.serve.quant_linear import Int8ChannelWeight

    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, s = int8_per_channel(w)
    return Int8ChannelWeight(q, s, torch.float32, int8_inputs), w, q, s


def test_w8a8_linear_is_the_int8_gemm_and_within_its_error_bound():
    """F.linear through a W8A8 weight equals the int8 GEMM written out in float64 (inputs rounded per
    token with scale max|x_row| / 127, vLLM's dynamic scheme; int products summed exactly; scaled by
    s_x * s_w), and its distance from the float product W x obeys the rounding bound: with
    |W^ - W| <= s_w / 2 and |x^ - x| <= s_x / 2 elementwise,
        |y^_i - y_i| <= s_wi / 2 * ||x||_1 + s_x / 2 * ||W_i||_1 + n * s_wi * s_x / 4,
    plus float32 summation (n * 2^-24 of sum |products|: 1e-4 of it is a wide margin)."""
    w8, w, q, s = _w8a8()
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    x[3] *= 40  # tokens of very different size: each gets its own scale
    b = torch.randn(48, generator=torch.Generator().manual_seed(2))
    got = F.linear(x, w8, b)

    xd = x.double()
    sx = xd.abs().amax(dim=1, keepdim=True) / 127
    qx = torch.round(xd / sx).clamp(-128, 127)
    exact = (qx @ q.double().T) * sx * s.double().T + b.double()
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()

    y = xd @ w.double().T + b.double()
    n = w.shape[1]
    bound = (s.double().T / 2 * xd.abs().sum(1, keepdim=True) + sx / 2 * w.double().abs().sum(1)
             + n * s.double().T * sx / 4 + 1e-4 * (xd.abs() @ w.double().abs().T))
    assert ((got.double() - y).abs() <= bound).all()
    assert (got.double() - y).abs().max() > 0  # it is quantized

    # weight-only (an int-quantized config without input activations) is the dequantized product
    wo, *_ = _w8a8(int8_inputs=False)
    assert torch.equal(F.linear(x, wo), F.linear(x, q.float() * s))
    # fused q/k/v stay int8 and keep the input scheme; one byte per weight plus a float32 scale per row
    fused = torch.cat([w8, _w8a8(16, 256, seed=3)[0]])
    assert fused.shape == (64, 256) and fused.int8_inputs and fused.nbytes == 64 * 256 + 64 * 4


def test_int8_inputs_read_from_the_config_and_other_schemes_refused():
    from stages.export.quantize import quantization_config
    from stages.serve.quant_linear import Int8ChannelWeight, int8_inputs_of

    conf = quantization_config("int8")
    assert int8_inputs_of(conf) is True and int8_inputs_of(None) is None
    assert int8_inputs_of(quantization_config("int4")) is None
    group = conf["config_groups"]["group_0"]
    static_inputs = {**group["input_activations"], "strategy": "tensor", "dynamic": False}
    static = {**conf, "config_groups": {"group_0": {**group, "input_activations": static_inputs}}}
    with pytest.raises(ValueError, match="'strategy': 'tensor'.*are not served"):
        int8_inputs_of(static)
    _, w, q, s = _w8a8()
    sd = {"model.layers.0.mlp.down_proj.weight": q, "model.layers.0.mlp.down_proj.weight_scale": s}
    got = take_quantized(sd, torch.float32, conf)
    assert isinstance(got["model.layers.0.mlp.down_proj.weight"], Int8ChannelWeight) and not sd
    with pytest.raises(KeyError, match="has no 'model.layers.0.mlp.down_proj.weight_scale'"):
        take_quantized({"model.layers.0.mlp.down_proj.weight": q}, torch.float32, conf)
