"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen linear layer W
plus a trainable low-rank update, y = W x + (alpha / r) * B A dropout(x), A [r, in] (Kaiming-uniform, as
PEFT) and B [out, r] (zeros, so training starts from the base model exactly). Seed: "LoRA, which
trains small low-rank adapter matrices, makes cheap variants possible."

`apply_lora` wraps the target modules in place and freezes everything else; `merged_state_dict`
folds W + (alpha / r) B A back into plain weights (what export writes); `save_peft` writes the
adapter in PEFT's layout (adapter_config.json + adapter_model.safetensors with keys
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`) against the Hugging Face names of
the exported base (ours plus a `model.` prefix), so PEFT and vLLM load it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from .model.bf16_matmul import Linear, linear

# Only the dense paths of a block: MoE experts live under `mlp.experts.E.` and are not adapted here.
TARGET = re.compile(r"^layers\.\d+\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$")


class LoRALinear(nn.Module):
    """A frozen nn.Linear's weight plus the adapter; the weight keeps its name (`q_proj.weight`)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if base.bias is not None:
            raise ValueError("LoRA here wraps bias-free linears (the model has none)")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.lora_A = Linear(self.in_features, r, device=base.weight.device)
        self.lora_B = Linear(r, self.out_features, device=base.weight.device)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = linear(x, self.weight)
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float, target_modules: list[str]) -> list[str]:
    """Wrap every dense linear whose last name is in `target_modules`; freeze all other parameters.
    Returns the wrapped module names. Only `lora_A` / `lora_B` train afterwards."""
    wanted = set(target_modules)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and TARGET.match(n) and n.rsplit(".", 1)[-1] in wanted]
    if not names:
        raise ValueError(f"LoRA target_modules={sorted(wanted)} match no dense linear layer of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, child = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), r, alpha, dropout))
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's plain state dict with every adapter folded in: W' = W + (alpha / r) B A."""
    loras = lora_modules(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        module = key.rsplit(".", 1)[0]
        if module in loras and key.endswith(".weight"):
            value = value + loras[module].delta_weight().to(value.dtype)
        out[key] = value.detach().clone()
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by a plain linear layer holding W + (alpha / r) B A (in place)."""
    for name, m in lora_modules(model).items():
        parent_name, child = name.rsplit(".", 1)
        merged = Linear(m.in_features, m.out_features, device=m.weight.device, dtype=m.weight.dtype)
        with torch.no_grad():
            merged.weight.copy_(m.weight + m.delta_weight().to(m.weight.dtype))
        setattr(model.get_submodule(parent_name), child, merged)
    return model


def peft_key(name: str) -> str:
    """Our adapter parameter name -> PEFT's key on the exported Hugging Face base (Llama names are ours
    under `model.`; PEFT adds `base_model.model.`)."""
    return "base_model.model.model." + name


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {peft_key(k): v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()
            if ".lora_A." in k or ".lora_B." in k}


def peft_config(model: nn.Module, base_model: str | None = None) -> dict:
    """adapter_config.json's content (PEFT's LoRA format) for the model's adapters."""
    loras = lora_modules(model)
    if not loras:
        raise ValueError("the model has no LoRA adapters to save")
    first = next(iter(loras.values()))
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.r,
        "lora_alpha": first.alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in loras}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model,
    }


def save_peft(model: nn.Module, out_dir: str | Path, base_model: str | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors in PEFT's LoRA format."""
    from safetensors.torch import save_file

    config = peft_config(model, base_model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(adapter_state_dict(model), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
