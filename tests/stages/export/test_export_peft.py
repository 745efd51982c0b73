"""Post-train LoRA adapters exported in PEFT format: the trainer's own adapter (trainer/lora.py, random
non-zero B so the update is real) passes the checks, and PEFT itself applying it to the exported base gives
transformers' logits of the exported merged model; an adapter that does not belong to the merged weights,
a misshapen factor and a key for a layer the model lacks each fail naming the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from export_models import random_model_state, tiny_cfg

from stages.export.hf import ExportError, write_hf
from stages.export.peft_adapter import find_adapter, read_adapter, write_peft_adapter


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A post-train-like output: adapter/ (PEFT, as the job saves it) beside the base and merged weights."""
    from trainer.lora import apply_lora, merged_state_dict, save_peft
    from trainer.model import Transformer

    cfg = tiny_cfg(n_layers=1)
    base = random_model_state(cfg)
    model = Transformer(cfg)
    model.load_state_dict(base)
    apply_lora(model, r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("posttrain_out")
    save_peft(model, out / "adapter")
    return cfg, base, merged_state_dict(model), out


def test_adapter_exported_beside_base_gives_the_merged_model(tmp_path, lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, base, merged, post = lora_run
    adapter = find_adapter(post)
    assert adapter is not None and find_adapter(tmp_path) is None
    write_hf(base, cfg, tmp_path / "base", dtype="float32")
    write_hf(merged, cfg, tmp_path / "hf", dtype="float32")
    info = write_peft_adapter(adapter, tmp_path / "adapter", cfg, base_model="../base", base=base, merged=merged)
    assert info["r"] == 4 and info["scaling"] == 2.0 and info["layers"] == 3 * cfg.n_layers
    assert info["target_modules"] == ["down_proj", "q_proj", "v_proj"] and info["merge_max_rel_diff"] < 1e-3
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "../base"

    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lora = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32),
                                         str(tmp_path / "adapter")).eval()
        want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()(tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32).eval()(tokens).logits
        got = lora(input_ids=tokens).logits
    assert (got - want).abs().max() < 1e-4
    assert (plain - want).abs().max() > 1e-2  # the adapter really changes the model


def test_adapter_checks_name_what_is_wrong(tmp_path, lora_run):
    from safetensors.torch import save_file

    cfg, base, merged, post = lora_run
    conf, tensors = read_adapter(post / "adapter")
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    off = {k: v.clone() for k, v in merged.items()}
    off["layers.0.self_attn.q_proj.weight"] += 1e-2  # merged from some other adapter
    with pytest.raises(ExportError, match="q_proj.weight: merged weight != base"):
        write_peft_adapter(post / "adapter", tmp_path / "a", cfg, base=base, merged=off)

    def broken(name, new_tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(conf))
        save_file(new_tensors, str(d / "adapter_model.safetensors"))
        return d

    bad_shape = broken("transposed", {**tensors, key: tensors[key].t().contiguous()})
    with pytest.raises(ExportError, match="q_proj.lora_B.weight' has shape"):
        write_peft_adapter(bad_shape, tmp_path / "b", cfg)
    bad_layer = broken("layer", {**tensors, key.replace("layers.0", "layers.7"): tensors[key].clone()})
    with pytest.raises(ExportError, match="layers.7.self_attn.q_proj, which the model does not have"):
        write_peft_adapter(bad_layer, tmp_path / "c", cfg)
