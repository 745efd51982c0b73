"""The hand-fused pieces of the step against the plain torch computations they replace: the LM head
fused with cross-entropy and z-loss (trainer/linear_cross_entropy.py), RMSNorm with its closed-form
backward (trainer/model/kernels.py), and CPU attention computed in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import trainer.linear_cross_entropy as lce
from infra.config.model import ModelConfig
from trainer.linear_cross_entropy import linear_cross_entropy_sum
from trainer.loss import IGNORE_INDEX, HeadLoss, cross_entropy_sum
from trainer.model import Transformer
from trainer.model.kernels import rms_norm
from trainer.model.transformer import causal_attention


def _head_inputs(seed=0, B=3, S=50, D=24, V=97):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g, requires_grad=True)
    weight = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[0, :7] = IGNORE_INDEX
    targets[2, -3:] = IGNORE_INDEX
    return hidden, weight, targets


def _run(fused: bool, hidden, weight, targets, z_loss, ce_weight, bf16):
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        h = hidden * 1.0  # a non-leaf, as the final norm's output is
        if fused:
            ce, z, n = linear_cross_entropy_sum(h, weight, targets, z_loss)
        else:
            out = cross_entropy_sum(F.linear(h, weight), targets, z_loss)
            ce, z, n = out.ce_sum, out.z_sum, out.tokens
    (ce * ce_weight + z).backward()
    return ce.detach(), z.detach(), n, hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
@pytest.mark.parametrize("ce_weight", [1.0, 2.5])  # 2.5 != z's weight: the exact recomputing backward
@pytest.mark.parametrize("small_chunks", [False, True])
def test_linear_cross_entropy_equals_logits_then_cross_entropy_fp32(monkeypatch, z_loss, ce_weight, small_chunks):
    if small_chunks:  # several softmax chunks and several weight-gradient blocks
        monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 16 * 97)
        monkeypatch.setattr(lce, "BLOCK_ELEMENTS", 64 * 97)
    hidden, weight, targets = _head_inputs()
    ref = _run(False, hidden, weight, targets, z_loss, ce_weight, bf16=False)
    got = _run(True, hidden, weight, targets, z_loss, ce_weight, bf16=False)
    assert int(got[2]) == int(ref[2]) == int((targets != IGNORE_INDEX).sum())
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[3], ref[3], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[4], ref[4], rtol=1e-4, atol=1e-6)
    assert got[3][0, :7].abs().max() == 0  # ignored positions get no gradient


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_linear_cross_entropy_bf16_matches_autocast_head(z_loss):
    hidden, weight, targets = _head_inputs(seed=1)
    ref = _run(False, hidden, weight, targets, z_loss, 1.0, bf16=True)
    got = _run(True, hidden, weight, targets, z_loss, 1.0, bf16=True)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
    for g, r in ((got[3], ref[3]), (got[4], ref[4])):  # bf16 gradients: a few bf16 ulps of the largest
        assert (g - r).abs().max() <= 1e-2 * r.abs().max()


def test_linear_cross_entropy_without_grad_gives_the_same_sums():
    hidden, weight, targets = _head_inputs(seed=2)
    with torch.no_grad():
        ce, z, n = linear_cross_entropy_sum(hidden, weight, targets, 1e-3)
        ref = cross_entropy_sum(F.linear(hidden, weight), targets, 1e-3)
    torch.testing.assert_close(ce, ref.ce_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(z, ref.z_sum, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy_sum(hidden, weight, targets[:, :-1])


def test_model_head_loss_equals_logits_loss_and_falls_back_on_a_hooked_head():
    cfg = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16, z_loss=1e-4)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 96, (2, 16))
    targets = torch.randint(0, 96, (2, 16))

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.total.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, float(loss.total.detach())

    ref_grads, ref_loss = grads(cross_entropy_sum(model(tokens), targets, cfg.z_loss))
    fused_grads, fused_loss = grads(model(tokens, head=HeadLoss(targets, cfg.z_loss)))
    assert fused_loss == pytest.approx(ref_loss, rel=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6)

    calls = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    try:  # a hooked head (as tensor parallel's) is called as a module: the fallback, same loss
        _, hooked_loss = grads(model(tokens, head=HeadLoss(targets, cfg.z_loss)))
    finally:
        handle.remove()
    assert calls == [torch.Size([2, 16, 96])]
    assert hooked_loss == pytest.approx(ref_loss, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_closed_form_backward_equals_composite(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 10, 48, generator=g) * 3).to(dtype).requires_grad_()
    w = (torch.rand(48, generator=g) + 0.5).requires_grad_()
    grad_out = torch.randn(4, 10, 48, generator=g).to(dtype)

    def run(fn):
        x.grad = w.grad = None
        y = fn()
        y.backward(grad_out)
        return y.detach(), x.grad.clone(), w.grad.clone()

    got = run(lambda: rms_norm(x, w, 1e-5, dtype))
    ref = run(lambda: F.rms_norm(x.float(), (48,), w, 1e-5).to(dtype))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


def test_cpu_bf16_attention_is_the_fp32_computation_rounded():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=g).bfloat16().requires_grad_()
    k = torch.randn(2, 2, 12, 8, generator=g).bfloat16().requires_grad_()
    v = torch.randn(2, 2, 12, 8, generator=g).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = causal_attention(q, k, v)
    assert y.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(y, ref.bfloat16(), rtol=0, atol=0)
    y.float().sum().backward()
    assert q.grad is not None and k.grad.dtype == torch.bfloat16
