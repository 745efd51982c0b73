"""LoRA: only adapters train, merging gives base + (alpha / r) B A and the same logits, and the PEFT
files load with `peft.PeftModel.from_pretrained` on the exported Hugging Face base to the same logits."""

import json

import pytest
import torch

from fixtures.posttrain import posttrain_config
from trainer.lora import LoRALinear, apply_lora, merge_lora, merged_state_dict, save_peft
from trainer.model import Transformer


def lora_model(seed=0, targets=("q_proj", "v_proj", "down_proj")):
    cfg = posttrain_config()
    torch.manual_seed(seed)
    model = Transformer(cfg.model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    names = apply_lora(model, r=4, alpha=8.0, dropout=0.0, target_modules=list(targets))
    return cfg, model, base, names


def test_only_adapters_train():
    cfg, model, base, names = lora_model()
    assert len(names) == 3 * cfg.model.n_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = model.state_dict()
    for k, v in base.items():
        assert torch.equal(state[k], v), f"{k} changed but only adapters may train"
    assert any(state[k].abs().sum() > 0 for k in state if ".lora_B." in k)  # B left zero-init: it trained


def test_merged_equals_base_plus_adapters():
    cfg, model, base, _ = lora_model(seed=1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05)
    merged = merged_state_dict(model)
    assert set(merged) == set(base)
    m = model.layers["0"].self_attn.q_proj
    want = base["layers.0.self_attn.q_proj.weight"] + (8.0 / 4) * m.lora_B.weight @ m.lora_A.weight
    torch.testing.assert_close(merged["layers.0.self_attn.q_proj.weight"], want)
    torch.testing.assert_close(merged["layers.0.self_attn.k_proj.weight"], base["layers.0.self_attn.k_proj.weight"])
    x = torch.randint(0, cfg.model.vocab_size, (2, 12))
    with torch.no_grad():
        with_adapter = model(x)
        plain = Transformer(cfg.model)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(x), with_adapter, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merge_lora(model)(x), with_adapter, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(mod, LoRALinear) for mod in model.modules())


@pytest.mark.slow
def test_peft_loads_the_adapter_on_the_exported_base(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from stages.export.hf import write_hf

    cfg, model, base, _ = lora_model(seed=2, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05)
    write_hf(base, cfg.model, tmp_path / "hf", dtype="float32")
    save_peft(model, tmp_path / "adapter", base_model=str(tmp_path / "hf"))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    x = torch.randint(0, cfg.model.vocab_size, (2, 12))
    with torch.no_grad():
        ours = model(x)
        theirs = peft_model(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    # and the adapter matters: the base alone differs
    with torch.no_grad(), peft_model.disable_adapter():
        assert (peft_model(input_ids=x).logits - ours).abs().max() > 1e-3
