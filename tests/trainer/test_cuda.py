"""The model's kernels on a CUDA device against their CPU result (marked `cuda`: skipped without one;
benchmarks/gpu/run.sh runs them on a GPU). Each computes the same thing on both devices from the same
inputs and compares, with the tolerance of the dtype the GPU computes in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infra.config.model import ModelConfig
from trainer.linear_cross_entropy import linear_cross_entropy_sum
from trainer.model import Transformer
from trainer.model.kernels import rms_norm
from trainer.model.moe import MoE
from trainer.model.transformer import causal_attention

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_sdpa_takes_the_flash_kernel_in_bf16_and_matches_cpu():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (_randn(2, 8, 256, 64, seed=s) for s in range(3))
    ref = causal_attention(q, k, v)  # fp32 on CPU
    qc, kc, vc = (t.to(CUDA, torch.bfloat16).requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # flash only: raises if SDPA cannot take it
        out = causal_attention(qc, kc, vc)
        out.float().square().sum().backward()
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    qr = q.clone().requires_grad_()
    causal_attention(qr, k, v).square().sum().backward()
    torch.testing.assert_close(qc.grad.float().cpu(), qr.grad, atol=5e-2, rtol=5e-2)


def test_fused_lm_head_loss_matches_cpu():
    hidden, weight = _randn(4, 128, 256, seed=1), _randn(1000, 256, seed=2, scale=0.05)
    targets = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(3))
    targets[0, :10] = -100

    def run(device):
        h, w = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            ce, z, n = linear_cross_entropy_sum(h * 1.0, w, targets.to(device), 1e-4)
        (ce + z).backward()
        return [t.detach().float().cpu() for t in (ce, z, n, h.grad, w.grad)]

    gpu, cpu = run(CUDA), run(torch.device("cpu"))
    assert gpu[2] == cpu[2]
    for a, b in zip(gpu[:2], cpu[:2]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    for a, b in zip(gpu[3:], cpu[3:]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=1e-3)


def test_rms_norm_backward_matches_cpu():
    x, w, g = _randn(8, 64, 512, seed=4), 1 + _randn(512, seed=5, scale=0.1), _randn(8, 64, 512, seed=6)

    def run(device):
        xd = x.to(device, torch.bfloat16).requires_grad_()
        wd = w.to(device).requires_grad_()
        y = rms_norm(xd, wd, 1e-5, torch.bfloat16)
        y.backward(g.to(device, torch.bfloat16))
        return [t.float().cpu() for t in (y.detach(), xd.grad, wd.grad)]

    for a, b in zip(run(CUDA), run(torch.device("cpu"))):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_moe_routing_matches_cpu():
    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=1, n_heads=4, ffn_dim=256,
                      moe={"num_experts": 8, "top_k": 2, "capacity_factor": 1.0})
    torch.manual_seed(0)
    moe = MoE(cfg.dim, cfg.ffn_dim, cfg.moe)
    x = _randn(4, 64, 128, seed=7)
    out_cpu = moe(x)
    load_cpu, dropped_cpu = moe.tokens_per_expert.clone(), float(moe.dropped_fraction)
    moe = moe.to(CUDA)
    out_gpu = moe(x.to(CUDA))
    assert torch.equal(moe.tokens_per_expert.cpu(), load_cpu)  # the same choices, the same drops
    assert float(moe.dropped_fraction) == pytest.approx(dropped_cpu)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-5)


def test_document_masked_forward_matches_cpu():
    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(8))
    documents = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [5] * 64])
    ref = model(tokens, documents=documents)
    model = model.to(CUDA)
    out = model(tokens.to(CUDA), documents=documents.to(CUDA))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-3, atol=1e-3)
    # a document's logits do not depend on the documents before it: the first row's third document
    # (its last 14 tokens) gives the same logits run alone
    alone = model(tokens[:1, 50:].to(CUDA))
    torch.testing.assert_close(out[0, 50:], alone[0], rtol=1e-3, atol=1e-3)
