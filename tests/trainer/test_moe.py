"""Mixture of experts: top-k routing against a hand-written reference, capacity dropping, and both
balancing methods lowering the load imbalance in a short training."""

import statistics

import pytest
import torch

from fixtures.trainer_data import tiny_config
from infra.config import LifecycleConfig
from infra.config.model import MoEConfig
from trainer.data import PackedLoader
from trainer.loop import LanguageModelling, build_model, train_step
from trainer.model.moe import MoE
from trainer.optim import build_optimizer


def layer(**kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(16, 24, MoEConfig(**{"num_experts": 4, "top_k": 2, **kw}))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_routes_each_token_to_its_top_k_experts():
    m = layer()
    x = torch.randn(3, 5, 16)
    out = m(x)
    flat = x.reshape(-1, 16)
    probs = torch.softmax(flat @ m.gate.weight.t(), dim=-1)
    ref = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        top = torch.topk(probs[t], 2)
        w = top.values / top.values.sum()
        for weight, e in zip(w, top.indices):
            ref[t] += weight * m.experts[int(e)](flat[t : t + 1])[0]
    torch.testing.assert_close(out.reshape(-1, 16), ref, atol=1e-5, rtol=1e-5)
    assert int(m.tokens_per_expert.sum()) == 15 * 2
    assert float(m.dropped_fraction) == 0.0


def test_capacity_drops_overflow_and_dropped_tokens_pass_through_unchanged():
    m = layer(top_k=1, capacity_factor=1.0)  # capacity = ceil(1.0 * 8 * 1 / 4) = 2 slots per expert
    with torch.no_grad():
        m.gate.weight.zero_()
        m.gate.weight[0, 0] = 10.0  # every token with x[0] > 0 prefers expert 0
    x = torch.randn(8, 16)
    x[:, 0] = 1.0
    out = m(x)
    assert m.capacity(8) == 2
    assert m.tokens_per_expert.tolist() == [8, 0, 0, 0]
    assert float(m.dropped_fraction) == pytest.approx(6 / 8)
    # The first two tokens (queue order) are served, the other six get nothing from the layer,
    # so a block's residual (h + moe(norm(h))) carries them through unchanged.
    assert out[:2].abs().sum() > 0
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_second_choices_are_dropped_before_first_choices():
    m = layer(top_k=2, capacity_factor=0.5)  # capacity = ceil(0.5 * 2 tokens * 2 / 4) = 1 slot per expert
    with torch.no_grad():
        m.gate.weight.zero_()
        m.gate.weight[0, 1], m.gate.weight[1, 1] = 3.0, 5.0  # token 0: expert 1, then expert 0
        m.gate.weight[0, 0], m.gate.weight[2, 0] = 10.0, 1.0  # token 1: expert 0, then expert 2
    x = torch.zeros(2, 16)
    x[0, 1], x[1, 0] = 1.0, 1.0
    out = m(x)
    _, experts, w = m.route(x)
    assert experts.tolist() == [[1, 0], [0, 2]]
    # Expert 0's one slot goes to token 1's first choice although token 0 comes first in the batch.
    e = m.experts
    with torch.no_grad():
        torch.testing.assert_close(out[0], w[0, 0] * e[1](x[:1])[0])
        torch.testing.assert_close(out[1], w[1, 0] * e[0](x[1:])[0] + w[1, 1] * e[2](x[1:])[0])
    assert float(m.dropped_fraction) == pytest.approx(1 / 4)


def bias_sign_update():
    m = layer(balance="bias", bias_update_rate=0.1)
    m.update_bias(torch.tensor([10.0, 0.0, 2.0, 4.0]))
    return m.expert_bias


def test_bias_update_moves_towards_underused_experts():
    torch.testing.assert_close(bias_sign_update(), torch.tensor([-0.1, 0.1, 0.1, 0.0]))  # mean load 4: expert 3 is on target


def train_imbalance(tokens, balance: str, coef: float = 0.0, rate: float = 0.0, steps: int = 40) -> float:
    """Mean max/mean expert load over the last 10 of `steps` steps of a tiny MoE language model."""
    cfg = tiny_config(steps=steps, lr=3e-3, micro_batch_size=8, global_batch_size=8)
    d = cfg.model_dump(mode="json")
    d["model"]["moe"] = dict(num_experts=4, top_k=1, balance=balance, aux_loss_coef=coef, bias_update_rate=rate)
    cfg = LifecycleConfig.model_validate(d)
    model = build_model(cfg, torch.device("cpu"), 0)
    opt = build_optimizer(model, cfg.pretrain)
    loader = PackedLoader(tokens / "train", seq_len=32, global_batch_size=8, micro_batch_size=8, seed=0)
    seen = []
    for s in range(steps):
        r = train_step(model, opt, loader.next_step(), LanguageModelling(), cfg.pretrain, s, torch.device("cpu"))
        seen.append(r.moe["moe_imbalance"])
    return statistics.fmean(seen[-10:])


@pytest.mark.slow
def test_balancing_lowers_imbalance(byte_tokens):
    unbalanced = train_imbalance(byte_tokens, "none")
    with_aux = train_imbalance(byte_tokens, "aux_loss", coef=0.1)
    with_bias = train_imbalance(byte_tokens, "bias", rate=0.002)
    assert unbalanced > 1.8  # without balancing, routing collapses towards few experts
    assert with_aux < 0.8 * unbalanced
    assert with_bias < 0.8 * unbalanced
