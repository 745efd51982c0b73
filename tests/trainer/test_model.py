"""The model against Hugging Face's Llama, parameter counts, and its pieces' contracts."""

import pytest
import torch

from infra.config import load_config
from infra.config.model import ModelConfig, MoEConfig
from trainer.model import Transformer, param_counts
from trainer.model.transformer import apply_rope, rope_cos_sin

TINY = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)


def hf_llama(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
    )
    return LlamaForCausalLM(hc).eval()


def to_hf_names(state: dict) -> dict:
    """Export is a prefix: every name but lm_head lives under `model.` in Hugging Face's layout."""
    return {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in state.items()}


@pytest.mark.parametrize("theta,tie", [(10000.0, False), (500.0, True)])
def test_logits_match_transformers_llama(theta, tie):
    cfg = ModelConfig(**TINY, rope_theta=theta, tie_embeddings=tie)
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    hf = hf_llama(cfg)
    hf.load_state_dict(to_hf_names(ours.state_dict()), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-4
    # The comparison can fail: another RoPE base gives different logits.
    other = hf_llama(cfg.model_copy(update={"rope_theta": theta * 3}))
    other.load_state_dict(to_hf_names(ours.state_dict()))
    with torch.no_grad():
        assert (ours(tokens) - other(tokens).logits).abs().max().item() > 2e-4


def test_explicit_positions_equal_default_and_shift_changes_output():
    cfg = ModelConfig(**TINY)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        a = model(tokens)
        b = model(tokens, positions=torch.arange(16).expand(2, 16))
        c = model(tokens, positions=torch.arange(16) + 5)
    torch.testing.assert_close(a, b)
    # RoPE is relative: a shift of all positions leaves attention scores (hence logits) unchanged.
    torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)


def test_rope_rotates_pairs_half_apart():
    cos, sin = rope_cos_sin(torch.tensor([1]), head_size=4, theta=10000.0)
    x = torch.tensor([[[[1.0, 0.0, 0.0, 0.0]]]])
    y = apply_rope(x, cos, sin)
    # rotate-half pairs dim 0 with dim 2 at angle 1 rad (frequency 1 for the first pair).
    torch.testing.assert_close(y[0, 0, 0], torch.tensor([torch.cos(torch.tensor(1.0)), 0.0, torch.sin(torch.tensor(1.0)), 0.0]))


def test_hf_parameter_names_and_stage_subsets():
    cfg = ModelConfig(**TINY, qk_norm=True)
    model = Transformer(cfg)
    names = set(model.state_dict())
    for n in ("embed_tokens.weight", "layers.1.input_layernorm.weight", "layers.1.self_attn.q_proj.weight",
              "layers.1.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight",
              "layers.1.self_attn.o_proj.weight", "layers.1.post_attention_layernorm.weight",
              "layers.1.mlp.gate_proj.weight", "layers.1.mlp.up_proj.weight", "layers.1.mlp.down_proj.weight",
              "layers.0.self_attn.q_norm.weight", "norm.weight", "lm_head.weight"):
        assert n in names, n
    # A pipeline stage keeps layer 1 only, with no embedding, final norm or head: hidden in, hidden out.
    full_hidden = None
    with torch.no_grad():
        tokens = torch.randint(0, cfg.vocab_size, (1, 8))
        h0 = model.layers["0"](model.embed_tokens(tokens), *rope_cos_sin(torch.arange(8), cfg.head_size, cfg.rope_theta))
        full_hidden = model.layers["1"](h0, *rope_cos_sin(torch.arange(8), cfg.head_size, cfg.rope_theta))
        del model.layers["0"]
        model.embed_tokens = model.norm = model.lm_head = None
        torch.testing.assert_close(model(h0), full_hidden)
    assert "layers.1.self_attn.q_proj.weight" in model.state_dict()


def test_param_counts_match_the_seed():
    cfg = load_config("configs/seed-1b.yaml").model
    dense = param_counts(cfg)
    assert round(dense["total"] / 1e9, 2) == 1.27
    assert dense["active"] == dense["total"]
    moe = param_counts(cfg.model_copy(update={"moe": MoEConfig(num_experts=8, top_k=2)}))
    assert abs(moe["total"] / 1e9 - 6.0) < 0.05
    assert abs(moe["active"] / 1e9 - 1.95) < 0.01
    # Counted another way: embedding + head + per layer attention (4 h^2) + 3 h f per expert.
    h, f, L, V = cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size
    assert dense["total"] == 2 * V * h + h + L * (4 * h * h + 3 * h * f + 2 * h)
    assert moe["active"] == 2 * V * h + h + L * (4 * h * h + 2 * 3 * h * f + 2 * h + 8 * h)


def test_mtp_depths_match_a_sliced_reference_and_leave_the_main_loss_alone():
    """Model with model.mtp_depth=2 (trainer/model/mtp.py): the main loss and the trunk's initial weights
    are those of the model without MTP (bit for bit), and depth 1's summed loss equals a reference that
    slices the sequence (positions 0..S-2 against tokens 2..S) instead of rolling it."""
    import numpy as np
    import torch.nn.functional as F

    from trainer.data import MicroBatch
    from trainer.model.transformer import rope_cos_sin
    from trainer.objectives import LanguageModelling

    cfg0 = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=32)
    cfg2 = cfg0.model_copy(update={"mtp_depth": 2})
    torch.manual_seed(0)
    plain = Transformer(cfg0)
    torch.manual_seed(0)
    mtp = Transformer(cfg2)
    sd = mtp.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in plain.state_dict().items())
    assert {k for k in sd if k.startswith("mtp.")} and not any(k.startswith("mtp.") for k in plain.state_dict())
    rows = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    mb = MicroBatch(inputs=rows[:, :-1], targets=rows[:, 1:].clone(), rows=np.arange(2))
    base = LanguageModelling().loss(plain, mb, torch.device("cpu"))
    part = LanguageModelling(mtp_depth=2, mtp_weight=0.3).loss(mtp, mb, torch.device("cpu"))
    assert torch.equal(base.ce_sum, part.ce_sum)
    assert part.mtp_sums[1].tolist() == [2 * 15, 2 * 14]  # depth k: S - k targets per row
    with torch.no_grad():
        cos, sin = rope_cos_sin(torch.arange(16), cfg2.head_size, cfg2.rope_theta)
        h = mtp.embed_tokens(rows[:, :-1])
        for layer in mtp.layers.values():
            h = layer(h, cos, sin)
        m = mtp.mtp[0]
        x = m.eh_proj(torch.cat([m.hnorm(h[:, :15]), m.enorm(mtp.embed_tokens(rows[:, 1:16]))], -1))
        logits = mtp.lm_head(m.norm(m.block(x, cos[:15], sin[:15])))
        ref = F.cross_entropy(logits.reshape(-1, 64), rows[:, 2:17].reshape(-1), reduction="sum")
    torch.testing.assert_close(part.mtp_sums[0, 0], ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(part.total, part.ce_sum + 0.3 / 2 * part.mtp_sums[0].sum(), rtol=1e-5, atol=1e-4)
