"""Validation catches the seed's two silent conversion bugs: a transposed shard and a wrong RoPE row order.
Both files load without any error in transformers; only the fixed check notices."""

from __future__ import annotations

import pytest
import torch
from export_models import single_thread
from safetensors.torch import load_file, save_file

from infra.config.export import ExportConfig
from stages.export.hf import write_hf
from stages.export.validate import (CheckData, ValidationFailed, build_reference, check_variant, enforce, our_forward,
                                    stored_weights, transformers_forward)


def corrupt(folder, fn):
    """Apply fn(name, tensor) -> tensor to every tensor of every shard, in place."""
    for f in folder.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: fn(k, v).contiguous() for k, v in tensors.items()}, str(f), metadata={"format": "pt"})


def meta_to_hf_permute(w, heads):
    """The row order Hugging Face's convert_llama_weights_to_hf applies to Meta checkpoints; applied to
    weights that are already in HF's half-split order, it is the wrong RoPE setting."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def checked(trained_tiny):
    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    prompts = [trained_tiny.val_rows[i, :6].tolist() for i in range(3)]
    data = CheckData(trained_tiny.val_rows, prompts, greedy_tokens=12)
    with single_thread():
        return cfg, sd, data, build_reference(our_forward(sd, cfg), data)


def run_check(folder, checked):
    cfg, sd, data, ref = checked
    th = ExportConfig().thresholds["hf"]
    rep = check_variant("hf", transformers_forward(folder), ref, data, th.max_ppl_ratio, th.min_greedy_agreement,
                        th.max_logit_diff)
    return rep


def test_correct_bf16_export_passes(tmp_path, checked):
    """Against the same model run on its bf16-rounded weights (what the export stage compares with), a
    correct bf16 conversion differs only by fp32 operation order: ~1e-6 of the largest logit."""
    cfg, sd, data, exact = checked
    write_hf(sd, cfg, tmp_path, dtype="bfloat16")
    ref = build_reference(our_forward(stored_weights(sd, torch.bfloat16), cfg), data)
    rep = run_check(tmp_path, (cfg, sd, data, ref))
    enforce([rep])
    assert rep.max_logit_diff < 1e-4 and rep.greedy_agreement == 1.0 and abs(rep.ppl_ratio - 1) < 1e-4
    # the cast itself is what the fp32 reference would have charged it
    assert run_check(tmp_path, checked).max_logit_diff > 10 * rep.max_logit_diff


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_bf16_gate_holds_on_a_confident_model(tmp_path, scale):
    """The regression of issue 20: a model with large, confident logits (a random model with its weights
    scaled up) exported to bf16. The cast alone moves its logits by several percent of the largest one
    (measured at scale 10: 0.044, against the old fixed bound of 0.05), which a bound against the fp32
    model calls a conversion bug on a confident enough model; against the bf16-rounded model the
    conversion is exact to float precision whatever the scale (measured: 3e-7 at 1, 2e-6 at 10)."""
    from export_models import random_model_state, tiny_cfg

    cfg = tiny_cfg()
    sd = {k: v * scale if v.dim() == 2 else v for k, v in random_model_state(cfg, seed=1).items()}
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (4, 33), generator=g)
    data = CheckData(rows, [rows[0, :5].tolist()], greedy_tokens=6)
    write_hf(sd, cfg, tmp_path, dtype="bfloat16")
    th = ExportConfig().thresholds["hf"]
    ref = build_reference(our_forward(stored_weights(sd, torch.bfloat16), cfg), data)
    rep = check_variant("hf", transformers_forward(tmp_path), ref, data, th.max_ppl_ratio, th.min_greedy_agreement,
                        th.max_logit_diff)
    enforce([rep])
    assert rep.max_logit_diff < th.max_logit_diff / 10


def test_correct_fp32_export_is_exact(tmp_path, checked):
    cfg, sd, _, _ = checked
    write_hf(sd, cfg, tmp_path, dtype="float32")
    rep = run_check(tmp_path, checked)
    assert rep.max_logit_diff < 1e-4 and rep.greedy_agreement == 1.0


def test_transposed_shard_is_caught(tmp_path, checked):
    cfg, sd, _, _ = checked
    write_hf(sd, cfg, tmp_path, dtype="float32")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert sd["layers.0.self_attn.q_proj.weight"].shape[0] == sd["layers.0.self_attn.q_proj.weight"].shape[1]
    corrupt(tmp_path, lambda k, v: v.t() if k == name else v)  # square: loads without a shape error
    rep = run_check(tmp_path, checked)
    with pytest.raises(ValidationFailed, match=r"variant hf: logits differ") as err:
        enforce([rep])
    print(err.value, rep)


def test_wrong_rope_permutation_is_caught(tmp_path, checked):
    cfg, sd, _, _ = checked
    write_hf(sd, cfg, tmp_path, dtype="float32")

    def permute(k, v):
        if k.endswith("self_attn.q_proj.weight"):
            return meta_to_hf_permute(v, cfg.n_heads)
        if k.endswith("self_attn.k_proj.weight"):
            return meta_to_hf_permute(v, cfg.kv_heads)
        return v

    corrupt(tmp_path, permute)
    rep = run_check(tmp_path, checked)
    with pytest.raises(ValidationFailed, match=r"variant hf: logits differ") as err:
        enforce([rep])
    print(err.value, rep)


def test_ppl_and_greedy_thresholds_name_the_metric(checked):
    """A variant that is merely worse (noisy weights) fails on the metric it crossed, with its name.
    The noise is seeded and large enough that the ratio is far over the bound whatever the fixture: over
    training seeds 0..15 x noise seeds 0..3 the ratio was 1.67..4.99 at std 0.1 (at the former unseeded
    0.05 it went as low as 1.04, under the 1.05 asserted)."""
    cfg, sd, data, ref = checked
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in sd.items()}
    rep = check_variant("int4", our_forward(noisy, cfg), ref, data, max_ppl_ratio=1.05, min_greedy_agreement=0.99)
    assert rep.ppl_ratio > 1.05
    with pytest.raises(ValidationFailed, match=r"variant int4: validation perplexity .*max_ppl_ratio 1.05"):
        enforce([rep])
