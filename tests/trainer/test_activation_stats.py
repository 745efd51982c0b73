"""Per-layer activation statistics (trainer/activation_stats.py) against the blocks run by hand; the
parallel layouts' figures are checked against one process in tests/parallel (par1/par2 workers)."""

from __future__ import annotations

import math

import pytest
import torch

from infra.config.model import ModelConfig
from trainer.activation_stats import ActivationStats
from trainer.model import Transformer
from trainer.model.transformer import rope_cos_sin
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)


def model_and_tokens(seed: int = 0) -> tuple[Transformer, torch.Tensor]:
    torch.manual_seed(seed)
    return Transformer(CFG), torch.randint(0, CFG.vocab_size, (4, 12))


def by_hand(model: Transformer, tokens: torch.Tensor) -> dict[str, float]:
    """Each block called directly on the previous one's output: no hooks involved."""
    out = {}
    with torch.no_grad():
        h = model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(torch.arange(tokens.shape[1]), CFG.head_size, CFG.rope_theta)
        for i, block in model.layers.items():
            h = block(h, cos, sin)
            out[f"act_rms/layer_{int(i):02d}"] = h.pow(2).mean().sqrt().item()
            out[f"act_absmax/layer_{int(i):02d}"] = h.abs().max().item()
    return out


def assert_same(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert math.isclose(got[k], want[k], rel_tol=1e-5), (k, got[k], want[k])


def test_statistics_are_those_of_each_block_output():
    model, tokens = model_and_tokens()
    stats = ActivationStats(model, CFG.n_layers, torch.device("cpu"))
    model(tokens)  # not recording: nothing counted
    assert stats.finish() == {}
    stats.start()
    model(tokens)
    got = stats.finish()
    assert_same(got, by_hand(model, tokens))
    # the residual stream grows through the blocks of a random model: the figures differ per layer
    assert len({round(v, 6) for k, v in got.items() if k.startswith("act_rms")}) == CFG.n_layers


def test_micro_batches_add_up_to_the_whole_batch():
    model, tokens = model_and_tokens(1)
    stats = ActivationStats(model, CFG.n_layers, torch.device("cpu"))
    stats.start()
    model(tokens[:1])
    model(tokens[1:])
    assert_same(stats.finish(), by_hand(model, tokens))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_leaves_the_figures_unchanged(mode):
    model, tokens = model_and_tokens(2)
    want = by_hand(model, tokens)
    apply_activation_checkpointing(model, mode)
    stats = ActivationStats(model, CFG.n_layers, torch.device("cpu"))
    stats.start()
    model(tokens).sum().backward()  # the backward recomputes the blocks
    assert_same(stats.finish(), want)
    stats.close()
    stats.start()
    model(tokens)
    assert stats.finish() == {}  # hooks removed


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="no transformer blocks"):
        ActivationStats(torch.nn.Linear(2, 2), 1, torch.device("cpu"))
