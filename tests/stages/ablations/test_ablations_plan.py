"""Proxy shapes, budgets and the sweep from the config; how pretrain takes the choice."""

import math

import pytest

from infra.config import ConfigError, load_config
from infra.config.ablations import AblationsConfig, ProxySize
from stages.ablations.choice import apply_choice
from stages.ablations.proxies import matmul_params, plan_sweep, proxy_model, target_budget, train_flops_per_token
from trainer.metrics import flops_per_token as trainer_flops_per_token
from trainer.model import Transformer


def test_proxy_shapes_keep_head_size_and_count_like_the_trainer():
    cfg = load_config("tiny")
    for size in (ProxySize(width=0.25, depth=0.25), ProxySize(width=0.5, depth=0.5), ProxySize(dim=96, n_layers=3)):
        m = proxy_model(cfg.model, size)
        assert m.head_size == cfg.model.head_size and m.n_heads % m.kv_heads == 0
        assert m.vocab_size == cfg.model.vocab_size
        # The estimator's FLOPs (used for C) against the trainer's own formula, and N against the real module.
        assert train_flops_per_token(m, 256) == pytest.approx(trainer_flops_per_token(m, 256))
        real = sum(p.numel() for p in Transformer(m).parameters())
        assert matmul_params(m) == real - m.vocab_size * m.dim  # N: all but the embedding lookup
    with pytest.raises(ValueError, match="multiple of the target head size 32"):
        proxy_model(cfg.model, ProxySize(dim=40))


def test_sweep_budget_follows_the_target_ratio_and_explicit_budgets():
    cfg = load_config("tiny")
    target = target_budget(cfg)
    points = plan_sweep(cfg)
    a = cfg.ablations
    assert len(points) == len({p.size for p in points}) * len(a.sweep.lr) >= 9
    assert len({p.size for p in points}) >= 3
    for p in points:
        assert p.tokens == p.train["steps"] * p.train["global_batch_size"] * cfg.pretrain.seq_len
        if a.max_steps is None or p.train["steps"] < a.max_steps:
            # within one step of the target's tokens per parameter
            step_tokens = p.train["global_batch_size"] * cfg.pretrain.seq_len
            assert abs(p.tokens - target["tokens_per_param"] * p.params) <= step_tokens
        assert p.train["eval_every"] == 0 and p.train["warmup_steps"] <= p.train["steps"]
    explicit = cfg.model_copy(update={"ablations": AblationsConfig(
        sizes=[ProxySize(dim=32, n_layers=1)], tokens_per_param=None, token_budgets=[40960, 81920],
        sweep={"lr": [1e-3, 1e-2], "global_batch_size": [8, 16]})})
    pts = plan_sweep(explicit)
    assert len(pts) == 2 * 2 * 2
    assert {p.tokens for p in pts} == {40960, 81920}
    assert {p.train["micro_batch_size"] for p in pts if p.axes["global_batch_size"] == 8} == {8}


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="tokens_per_param"):
        load_config("tiny", ["ablations.tokens_per_param=null"])
    with pytest.raises(ConfigError, match="sweep.lr"):
        load_config("tiny", ["ablations.sweep.lr=[0.001,0.001]"])


def test_pretrain_takes_the_choice_unless_pinned():
    cfg = load_config("tiny", ["ablations.pinned=[]"])  # configs/tiny.yaml pins lr; start from none
    choice = {"lr": 1e-3, "global_batch_size": 24, "schedule": "wsd"}
    new, taken = apply_choice(cfg, choice)
    assert taken == choice and new.pretrain.lr == 1e-3 and new.pretrain.global_batch_size == 24
    assert 24 % new.pretrain.micro_batch_size == 0 and new.pretrain.steps == cfg.pretrain.steps
    pinned = load_config("tiny", ["ablations.pinned=[lr]"])
    new, taken = apply_choice(pinned, choice)
    assert "lr" not in taken and new.pretrain.lr == cfg.pretrain.lr
    off = load_config("tiny", ["ablations.use_ablations=false"])
    assert apply_choice(off, choice) == (off, {})
    assert math.isclose(target_budget(new)["tokens"], cfg.pretrain.steps * 24 * cfg.pretrain.seq_len)
