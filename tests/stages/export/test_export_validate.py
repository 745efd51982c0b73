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
                                    transformers_forward)


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
    cfg, sd, _, _ = checked
    write_hf(sd, cfg, tmp_path, dtype="bfloat16")
    rep = run_check(tmp_path, checked)
    enforce([rep])
    # bf16 rounding of the weights moves logits by ~2^-9 relative: a near-tie in the tiny model's flat
    # logits may flip one greedy token (and the continuation after it), so agreement is the product's bar
    assert rep.max_logit_diff < 0.02 and rep.greedy_agreement >= ExportConfig().thresholds["hf"].min_greedy_agreement


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
    """A variant that is merely worse (noisy weights) fails on the metric it crossed, with its name."""
    cfg, sd, data, ref = checked
    noisy = {k: v + 0.05 * torch.randn_like(v) if v.dim() == 2 else v for k, v in sd.items()}
    rep = check_variant("int4", our_forward(noisy, cfg), ref, data, max_ppl_ratio=1.05, min_greedy_agreement=0.99)
    assert rep.ppl_ratio > 1.05
    with pytest.raises(ValidationFailed, match=r"variant int4: validation perplexity .*max_ppl_ratio 1.05"):
        enforce([rep])
