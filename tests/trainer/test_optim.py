"""Schedules, weight-decay groups, clipping and the loss terms, against hand-computed values."""

import math

import pytest
import torch

from infra.config.train import TrainConfig
from trainer.loss import cross_entropy_sum
from trainer.model import Transformer
from trainer.optim import build_optimizer, clip_grad_norm, lr_at, param_groups
from infra.config.model import ModelConfig


def test_cosine_warmup_to_floor():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos(pi/2) = 0
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_wsd_and_constant():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=2.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, cfg) == pytest.approx(2.0)
    assert lr_at(79, cfg) == pytest.approx(2.0)
    assert lr_at(90, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.0)
    const = TrainConfig(steps=100, warmup_steps=4, lr=2.0, schedule="constant")
    assert lr_at(1, const) == pytest.approx(1.0) and lr_at(99, const) == 2.0


def test_weight_decay_skips_norms():
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=16))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("norm.weight") for p in no_decay["params"])
    assert len(no_decay["params"]) == 3  # input, post-attention, final norm
    assert any(names[id(p)] == "embed_tokens.weight" for p in decay["params"])
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_clip_reports_norm_before_clipping():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    norm = clip_grad_norm([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(math.sqrt(9 * 3 + 16 * 4))
    total = torch.cat([a.grad, b.grad]).norm()
    assert total.item() == pytest.approx(1.0, rel=1e-5)


def test_token_cross_entropy_and_z_loss_by_hand():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]])
    targets = torch.tensor([[0, -100]])
    out = cross_entropy_sum(logits, targets, z_loss=1e-2)
    lse = math.log(math.exp(2) + 1 + math.exp(-1))
    assert out.tokens.item() == 1
    assert out.ce_sum.item() == pytest.approx(lse - 2.0, rel=1e-6)
    assert out.z_sum.item() == pytest.approx(1e-2 * lse**2, rel=1e-6)
