"""Post-train LoRA adapters exported beside the model in PEFT's format (issue: "its LoRA adapters are merged
or exported beside it in PEFT format").

The post-train job already writes both forms (trainer/lora.py): `model.safetensors` with the adapters merged
(W' = W + (alpha / r) B A, what hf/ is written from) and `adapter/` in PEFT's layout against the Hugging Face
names of the base. This module checks that adapter before it ships and writes it into the export artifact:
every key names a LoRA factor of a linear layer the model has, each factor's shape fits that layer and the
rank, and -- given the base and merged weights -- the merged weights are exactly base + scaling * B A (a
transposed factor, a wrong alpha or an adapter from another run all fail here, naming the tensor), so that
PEFT or vLLM applying the adapter to the base gives the model that hf/ holds.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from infra.config.model import ModelConfig

from .hf import ExportError
from .merge import expected_shapes

# PEFT's key for our layer `layers.N.self_attn.q_proj` on a Llama base: base_model.model.model.layers.N....
PEFT_KEY = re.compile(r"^base_model\.model\.model\.(layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)\.lora_([AB])\.weight$")


def find_adapter(posttrain_out: str | Path) -> Path | None:
    """The post-train output's PEFT adapter folder, or None when it was trained without LoRA."""
    folder = Path(posttrain_out) / "adapter"
    return folder if (folder / "adapter_config.json").is_file() else None


def read_adapter(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        if not (adapter_dir / f).is_file():
            raise FileNotFoundError(f"{adapter_dir} is not a PEFT adapter folder (no {f})")
    return (json.loads((adapter_dir / "adapter_config.json").read_text()),
            load_file(str(adapter_dir / "adapter_model.safetensors")))


def lora_scaling(conf: dict[str, Any]) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r, alpha = conf["r"], conf["lora_alpha"]
    return alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r


def adapter_factors(conf: dict[str, Any], tensors: dict[str, torch.Tensor],
                    cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our layer name -> (A [r, in], B [out, r]), every key and shape checked against the model."""
    if conf.get("peft_type") != "LORA":
        raise ExportError(f"adapter peft_type is {conf.get('peft_type')!r}; only LORA is exported")
    if conf.get("use_dora") or conf.get("modules_to_save") or conf.get("bias", "none") != "none":
        raise ExportError("adapter uses DoRA, modules_to_save or trained biases, which this export does not check")
    r = int(conf["r"])
    shapes = expected_shapes(cfg)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = PEFT_KEY.match(key)
        if m is None:
            raise ExportError(f"adapter tensor {key!r} is not a LoRA factor of a decoder linear layer")
        layer, which = m.groups()
        want = shapes.get(layer + ".weight")
        if want is None:
            raise ExportError(f"adapter tensor {key!r} adapts {layer}, which the model does not have")
        out_f, in_f = want
        expect = (r, in_f) if which == "A" else (out_f, r)
        if tuple(t.shape) != expect:
            raise ExportError(f"adapter tensor {key!r} has shape {tuple(t.shape)}, expected {expect} (r={r})")
        parts.setdefault(layer, {})[which] = t
    missing = [f"{layer}.lora_{w}" for layer, p in parts.items() for w in "AB" if w not in p]
    if missing or not parts:
        raise ExportError(f"adapter is incomplete: missing {missing or 'every factor'}")
    return {layer: (p["A"], p["B"]) for layer, p in parts.items()}


def check_merged(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                 base: dict[str, torch.Tensor], merged: dict[str, torch.Tensor], rtol: float = 1e-3) -> float:
    """merged == base + scaling * B A on adapted layers and == base elsewhere (our names); returns the
    largest difference relative to the largest update. Fails naming the first tensor that does not fit."""
    worst = 0.0
    for name, w in base.items():
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if name not in merged:
            raise ExportError(f"merged weights have no {name!r}")
        got = merged[name].float()
        if layer in factors:
            a, b = factors[layer]
            delta = (b.float() @ a.float()) * scaling
            err = (got - (w.float() + delta)).abs().max().item()
            # bf16 weights round W + delta: allow their rounding on top of the relative tolerance
            allow = rtol * delta.abs().max().item() + w.float().abs().max().item() * torch.finfo(merged[name].dtype).eps
            if err > allow:
                raise ExportError(f"{name}: merged weight != base + {scaling:g} * B A (max diff {err:.3g}, "
                                  f"allowed {allow:.3g}): the adapter does not belong to these weights")
            worst = max(worst, err / max(delta.abs().max().item(), 1e-30))
        elif not torch.equal(got, w.float()):
            raise ExportError(f"{name} differs between base and merged weights but has no adapter")
    return worst


def write_peft_adapter(adapter_dir: str | Path, out_dir: str | Path, cfg: ModelConfig,
                       base_model: str | None = None, base: dict[str, torch.Tensor] | None = None,
                       merged: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Check the post-train adapter (and, given both, that merged = base + adapter) and write it to
    `out_dir` in PEFT's layout, `base_model_name_or_path` set to `base_model` (the exported base folder
    PEFT / vLLM should apply it to). Returns a summary for the stage output."""
    from safetensors.torch import save_file

    conf, tensors = read_adapter(adapter_dir)
    factors = adapter_factors(conf, tensors, cfg)
    summary: dict[str, Any] = {"r": int(conf["r"]), "lora_alpha": conf["lora_alpha"], "scaling": lora_scaling(conf),
                               "layers": len(factors), "target_modules": sorted({n.rsplit(".", 1)[-1] for n in factors})}
    if base is not None and merged is not None:
        summary["merge_max_rel_diff"] = check_merged(factors, summary["scaling"], base, merged)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conf = {**conf, "base_model_name_or_path": base_model, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(conf, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    summary["bytes"] = sum(f.stat().st_size for f in out.iterdir())
    return summary
