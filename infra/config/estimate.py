"""`estimate:` the hardware and accounting assumptions behind `eightfold estimate` (seed: H100 at 40% MFU)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class EstimateConfig(Section):
    """What the formulas cannot read from the model and the mesh: the GPU, the utilisation, the run length."""

    gpu_peak_flops: float = Field(989e12, gt=0, description="peak FLOP/s per GPU (H100 SXM dense bf16: 989e12)")
    mfu: float = Field(0.4, gt=0, le=1, description="model FLOPs utilisation assumed for step time (seed: 40%)")
    gpu_memory_bytes: float = Field(80e9, gt=0, description="memory per GPU (H100: 80 GB)")
    gpus: int | None = Field(None, ge=1, description="GPUs for step time and run length; default the mesh's world size")
    total_tokens: float | None = Field(
        None, gt=0, description="tokens of the whole run for run FLOPs and GPU-years (Llama 3.1 405B: 15.6e12)"
    )
    activation_recompute: Literal["none", "selective", "full"] | None = Field(
        None, description="none, selective (attention core) or full (keep only each layer's input); default pretrain.activation_checkpointing"
    )
    flash_attention: bool = Field(True, description="FlashAttention: the s x s attention scores are never stored")
    attention_flops: Literal["full", "causal"] = Field(
        "full",
        description="full: count the whole s x s score matrix (PaLM/Megatron MFU convention, the seed's ~16 TFLOP, "
        "what torch's FLOP counter reports); causal: only the lower triangle that a causal kernel needs",
    )
