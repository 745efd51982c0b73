"""The fixed check every exported variant re-runs against the unquantized model (seed: "Validate. Re-run
evaluations on the converted, quantized model. Conversion bugs, such as a transposed shard or a wrong
RoPE setting, are common and silent").

Every variant is compared with the model as that variant stores it before any quantization, run by our
own implementation in fp32 (`stored_weights`): hf/ and the compressed-tensors variants with every tensor
in `export.dtype`, GGUF with its matrices in F16/BF16 (or fp32 before its block quantization). So the
lossless conversions (hf, gguf-f16, gguf-bf16) must match to float precision whatever the model, and a
quantized variant is charged only for its quantization. The cast itself (fp32 -> export.dtype) is
reported in validation.json, not gated: the cast model is the model that ships, and evaluate scores it.

Metrics, with thresholds per variant from `export.thresholds`:
  max_logit_diff     max |logit - reference logit| / max |reference logit| (lossless variants)
  ppl_ratio          validation perplexity on held-out token rows / the unquantized model's (and, for
                     post-trained models, the same on held-out conversations in the chat template)
  greedy_agreement   the unquantized model's greedy continuations of fixed prompts are fed to the variant
                     (teacher forcing) and we count how often the variant's argmax picks the same token.
                     Teacher forcing keeps one near-tie from flipping every later token, so the number
                     measures the variant, not the chaos of free-running decoding.
A variant is loaded the way its consumers load it: `hf/` through transformers (an implementation that
is not ours), quantized folders through the compressed-tensors reference dequantizer, GGUF through
gguf.GGUFReader. A transposed matrix or a wrong RoPE row order loads without error and fails here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infra.config.model import ModelConfig

Forward = Callable[[torch.Tensor], torch.Tensor]  # tokens [B, S] -> logits [B, S, V] (float32)


class ValidationFailed(RuntimeError):
    """A variant crossed a threshold; the message names the variant, the metric and the limit."""


@dataclass
class CheckData:
    rows: torch.Tensor  # [N, S + 1] held-out token rows: inputs row[:-1], targets row[1:]
    prompts: list[list[int]]  # fixed prompts as token ids
    greedy_tokens: int = 16
    chat_rows: torch.Tensor | None = None  # [M, S' + 1] held-out conversations (chat models), checked alike


@dataclass
class Reference:
    ppl: float
    continuations: list[list[int]]
    logits: torch.Tensor  # [N, S, V] of the unquantized model on the validation inputs
    chat_ppl: float | None = None
    chat_logits: torch.Tensor | None = None


@dataclass
class VariantReport:
    variant: str
    ppl: float
    ppl_ratio: float
    greedy_agreement: float
    max_logit_diff: float  # max |logit - reference logit| / max |reference logit|
    chat_ppl_ratio: float | None = None  # the same ratio on held-out conversations (chat models)
    passed: bool = True
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def logits_of(forward: Forward, rows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    return torch.cat([forward(rows[i:i + batch, :-1]).float() for i in range(0, rows.shape[0], batch)])


def perplexity_from_logits(logits: torch.Tensor, rows: torch.Tensor) -> float:
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    return math.exp(float(ce))


@torch.no_grad()
def greedy(forward: Forward, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` (full recompute each step: the models here are tiny)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(forward(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def greedy_agreement(forward: Forward, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Share of continuation positions where the variant's argmax, given the reference's own prefix,
    is the reference's greedy token."""
    same = total = 0
    for prompt, cont in zip(prompts, continuations):
        ids = torch.tensor([prompt + cont[:-1]])
        pred = forward(ids)[0, len(prompt) - 1:].argmax(dim=-1)
        same += int((pred == torch.tensor(cont)).sum())
        total += len(cont)
    return same / max(total, 1)


def stored_weights(sd: dict[str, torch.Tensor], dtype: torch.dtype, matrices_only: bool = False) -> dict[str, torch.Tensor]:
    """The weights as an export stores them before any quantization (every tensor in `dtype`, or only the
    matrices, as GGUF keeps norms in F32), back in fp32. The model run on these is the reference a
    lossless conversion must reproduce: then the bound on a bf16 or fp16 export no longer depends on
    what rounding does to this model's logits (which grows with how confident the model is), only on
    the implementation, and a transposed or permuted tensor still fails by orders of magnitude."""
    return {k: v.to(dtype).float() if (v.is_floating_point() and (v.dim() >= 2 or not matrices_only)) else v
            for k, v in sd.items()}


def build_reference(forward: Forward, data: CheckData) -> Reference:
    logits = logits_of(forward, data.rows)
    conts = [greedy(forward, p, data.greedy_tokens) for p in data.prompts]
    ref = Reference(perplexity_from_logits(logits, data.rows), conts, logits)
    if data.chat_rows is not None:
        ref.chat_logits = logits_of(forward, data.chat_rows)
        ref.chat_ppl = perplexity_from_logits(ref.chat_logits, data.chat_rows)
    return ref


def relative_diff(logits: torch.Tensor, ref: torch.Tensor) -> float:
    # relative to the largest reference logit, so the limit does not depend on the model's logit scale
    return float((logits - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def check_variant(variant: str, forward: Forward, ref: Reference, data: CheckData, max_ppl_ratio: float,
                  min_greedy_agreement: float, max_logit_diff: float | None = None) -> VariantReport:
    logits = logits_of(forward, data.rows)
    ppl = perplexity_from_logits(logits, data.rows)
    ratio = ppl / ref.ppl if math.isfinite(ppl) else float("inf")
    agree = greedy_agreement(forward, data.prompts, ref.continuations)
    diff = relative_diff(logits, ref.logits)
    rep = VariantReport(variant, ppl, ratio, agree, diff)
    if data.chat_rows is not None and ref.chat_logits is not None:
        chat_logits = logits_of(forward, data.chat_rows)
        chat_ppl = perplexity_from_logits(chat_logits, data.chat_rows)
        rep.chat_ppl_ratio = chat_ppl / ref.chat_ppl if math.isfinite(chat_ppl) else float("inf")
        rep.max_logit_diff = diff = max(diff, relative_diff(chat_logits, ref.chat_logits))
    if max_logit_diff is not None and not diff <= max_logit_diff:
        rep.failures.append(f"variant {variant}: logits differ from the unquantized model's by {diff:.3g} of the "
                            f"largest logit (max_logit_diff {max_logit_diff}): a conversion bug, not rounding")
    if not ratio <= max_ppl_ratio:
        rep.failures.append(f"variant {variant}: validation perplexity {ppl:.4g} is {ratio:.4f}x the unquantized "
                            f"model's {ref.ppl:.4g} (max_ppl_ratio {max_ppl_ratio}); relative logit diff {diff:.3g}")
    if rep.chat_ppl_ratio is not None and not rep.chat_ppl_ratio <= max_ppl_ratio:
        rep.failures.append(f"variant {variant}: perplexity on held-out conversations is {rep.chat_ppl_ratio:.4f}x "
                            f"the unquantized model's {ref.chat_ppl:.4g} (max_ppl_ratio {max_ppl_ratio})")
    if not agree >= min_greedy_agreement:
        rep.failures.append(f"variant {variant}: greedy token agreement {agree:.3f} with the unquantized model is "
                            f"below min_greedy_agreement {min_greedy_agreement}; relative logit diff {diff:.3g}")
    rep.passed = not rep.failures
    return rep


def enforce(reports: list[VariantReport]) -> None:
    failures = [f for r in reports for f in r.failures]
    if failures:
        raise ValidationFailed("export validation failed:\n  " + "\n  ".join(failures))


# -- ways to load a variant -------------------------------------------------------------------------


def reference_config(cfg: ModelConfig) -> ModelConfig:
    """Inference routing: no capacity limit, so no token is dropped (what Mixtral / Qwen2-MoE do)."""
    if cfg.moe is None:
        return cfg
    return cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"capacity_factor": None})})


def our_forward(sd: dict[str, torch.Tensor], cfg: ModelConfig, fp8_activations: bool = False,
                int8_activations: bool = False) -> Forward:
    """Our model in fp32 with the given weights; `fp8_activations` / `int8_activations` round every block
    linear's input to FP8 / INT8 with a per-token scale, as a W8A8 kernel would."""
    from trainer.model import Transformer

    from .quantize import fake_quant_fp8_per_token, fake_quant_int8_per_token

    model = Transformer(reference_config(cfg))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("expert_bias")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    if fp8_activations or int8_activations:
        fake_quant = fake_quant_fp8_per_token if fp8_activations else fake_quant_int8_per_token
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and name.startswith("layers.") and not name.endswith("mlp.gate"):
                mod.register_forward_pre_hook(lambda m, args: (fake_quant(args[0]),))
    return lambda tokens: model(tokens).float()


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """AutoModelForCausalLM.from_pretrained without its per-tensor "Loading weights" bar, which in a stage's
    log is one noisy line per small model loaded (restored afterwards)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def transformers_forward(hf_dir: str | Path) -> Forward:
    """The folder loaded by transformers itself, in fp32."""
    model = load_causal_lm(hf_dir)
    return lambda tokens: model(tokens).logits.float()


def load_hf_folder(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """Our-named fp32 weights, our ModelConfig and config.json of an hf/ or quantized/<variant>/ folder,
    through the reference dequantizer."""
    from .hf import from_hf_state_dict, model_config_from_hf, read_safetensors
    from .quantize import dequantize_state_dict

    model_dir = Path(model_dir)
    conf = json.loads((model_dir / "config.json").read_text())
    cfg, arch = model_config_from_hf(conf)
    tensors = dequantize_state_dict(read_safetensors(model_dir), conf.get("quantization_config"), torch.float32)
    return from_hf_state_dict(tensors, cfg, arch), cfg, conf


def folder_forward(model_dir: str | Path) -> Forward:
    sd, cfg, conf = load_hf_folder(model_dir)
    q = conf.get("quantization_config") or {}
    acts = (q.get("config_groups") or {}).get("group_0", {}).get("input_activations")
    quantized_inputs = bool(acts) and acts.get("num_bits") == 8 and acts.get("strategy") == "token"
    return our_forward(sd, cfg, fp8_activations=quantized_inputs and acts.get("type") == "float",
                       int8_activations=quantized_inputs and acts.get("type") == "int")


def gguf_forward(path: str | Path, cfg: ModelConfig) -> Forward:
    from .gguf_export import read_gguf

    _, sd = read_gguf(path)
    return our_forward(sd, cfg)
