"""`export:` merge the trained checkpoint into Hugging Face safetensors, quantize, validate every variant
(seed, export chapter: merge the shards, convert, quantize, validate)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import Section

VARIANTS = ("fp8", "int8", "int4", "int4-awq", "gguf-f16", "gguf-bf16", "gguf-q8_0", "gguf-q4_0")


class VariantThreshold(Section):
    """What a variant may lose against the unquantized export before the stage fails."""

    max_ppl_ratio: float = Field(1.05, ge=1.0, description="validation perplexity / unquantized perplexity, at most")
    min_greedy_agreement: float = Field(
        0.5, ge=0.0, le=1.0, description="share of greedy continuation tokens equal to the unquantized model's, at least"
    )
    max_logit_diff: float | None = Field(
        None, gt=0, description="max |logit - unquantized logit| / max |unquantized logit|, at most (None: not checked)"
    )


def _default_thresholds() -> dict[str, VariantThreshold]:
    # Every variant is compared with the model as it stores it before quantization (stages/export/validate.py:
    # stored_weights), so these bound only the conversion and the quantization, never the dtype cast.
    # Quantized variants: loose enough for a tiny model whose logits are nearly flat (one flipped argmax
    # early in a greedy continuation changes every later token), tight enough that a transposed or
    # permuted tensor fails.
    t = VariantThreshold
    return {
        # Lossless conversions run the very same weights: only fp32 operation order differs (measured
        # ~1e-6 of the largest logit), while a transposed or permuted tensor moves them by ~1e-1.
        "hf": t(max_ppl_ratio=1.01, min_greedy_agreement=0.9, max_logit_diff=1e-3),
        # E4M3 keeps 3 mantissa bits (up to 6% relative per weight and activation): on the tiny model's
        # held-out conversations (low perplexity, so each nat shows) W8A8 measured 0.98..1.04x
        "fp8": t(max_ppl_ratio=1.10, min_greedy_agreement=0.5),
        "int8": t(max_ppl_ratio=1.02, min_greedy_agreement=0.6),
        "int4": t(max_ppl_ratio=1.30, min_greedy_agreement=0.25),
        "int4-awq": t(max_ppl_ratio=1.30, min_greedy_agreement=0.25),
        "gguf-f16": t(max_ppl_ratio=1.01, min_greedy_agreement=0.8, max_logit_diff=1e-3),
        "gguf-bf16": t(max_ppl_ratio=1.02, min_greedy_agreement=0.6, max_logit_diff=1e-3),
        "gguf-q8_0": t(max_ppl_ratio=1.02, min_greedy_agreement=0.6),
        "gguf-q4_0": t(max_ppl_ratio=1.40, min_greedy_agreement=0.2),
    }


class ExportConfig(Section):
    """The export stage: Hugging Face layout, quantized variants and the checks each must pass."""

    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype of the hf/ weights (seed: 2.5 GB of bf16 weights for the 1.27B model)"
    )
    shard_size_mb: float = Field(
        4900.0, gt=0, description="largest safetensors shard; model.safetensors.index.json maps tensors to shards"
    )
    moe_architecture: Literal["auto", "mixtral", "qwen2_moe"] = Field(
        "auto", description="auto: Mixtral when every layer is MoE without a shared expert, else Qwen2-MoE"
    )
    variants: list[Literal[VARIANTS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["fp8", "int8", "int4", "int4-awq", "gguf-f16", "gguf-q8_0", "gguf-q4_0"],
        description=f"quantized variants to write under quantized/<variant>/; known: {', '.join(VARIANTS)}",
    )
    fp8_activations: bool = Field(
        True, description="FP8 variant declares dynamic per-token FP8 input activations (W8A8), else weight-only"
    )
    int4_group_size: int = Field(128, ge=8, description="INT4 weights share one scale per this many inputs")
    awq_calibration_rows: int = Field(16, ge=1, description="validation token rows used to measure activations for AWQ")
    awq_grid: int = Field(20, ge=2, description="AWQ: alpha values tried in [0, 1) per scaled group")
    validation_rows: int = Field(8, ge=1, description="held-out token rows for the perplexity check")
    validation_seq_len: int | None = Field(None, ge=2, description="tokens per validation row (default: the row's)")
    chat_validation_rows: int = Field(
        4, ge=0, description="rows of held-out conversations (posttrain.task's held-out problems in the chat template) "
        "on which post-trained models are also checked; 0 = none")
    prompts: list[str] = Field(
        default_factory=lambda: ["def main(", "import os\n", "class Config:", "    return "],
        min_length=1,
        description="fixed prompts whose greedy continuations every variant must reproduce",
    )
    greedy_tokens: int = Field(16, ge=1, description="tokens generated per prompt in the greedy check")
    thresholds: dict[str, VariantThreshold] = Field(
        default_factory=_default_thresholds, description="per variant (and 'hf' for the unquantized conversion)"
    )
    source: Literal["final", "pretrain", "posttrain-sft", "posttrain-dpo", "posttrain-grpo"] = Field(
        "final",
        description="the model that becomes hf/ and every quantized variant; final: the last step of the chain "
        "(posttrain-grpo; a disabled post-train step passes its input through)",
    )
    lineage: bool = Field(
        True,
        description="also export every earlier model of the chain (pretrain, sft, dpo) unquantized to <step>/hf, "
        "so evaluate compares the whole lifecycle in one table",
    )
    register_model: bool = Field(
        True, description="register every exported folder (hf/, the lineage, each quantized variant) as a version in the "
        "MLflow model registry; evaluate then sets the champion or challenger alias, serve deploys the champion")
    registered_model_name: str | None = Field(None, description="default: the config name")

    @field_validator("thresholds", mode="before")
    @classmethod
    def _over_defaults(cls, value):
        """Given thresholds override the defaults field by field; variants not named keep theirs."""
        merged = {k: t.model_dump() for k, t in _default_thresholds().items()}
        for variant, given in (value or {}).items():
            given = given.model_dump(exclude_unset=True) if isinstance(given, VariantThreshold) else dict(given)
            merged[variant] = {**merged.get(variant, {}), **given}
        return merged

    @model_validator(mode="after")
    def _thresholds_known(self) -> "ExportConfig":
        unknown = sorted(set(self.thresholds) - set(VARIANTS) - {"hf"})
        if unknown:
            raise ValueError(f"export.thresholds has unknown variant(s) {unknown}; known: hf, {', '.join(VARIANTS)}")
        missing = [v for v in ["hf", *self.variants] if v not in self.thresholds]
        if missing:
            raise ValueError(f"export.thresholds has no entry for {missing}")
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"export.variants lists a variant twice: {self.variants}")
        return self
