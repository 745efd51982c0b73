"""`estimate:` the hardware and accounting assumptions behind `eightfold estimate` (seed: H100 at 40% MFU)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class ServeEstimateConfig(Section):
    """`estimate.serve:` one model served on `tp` GPUs (seed, "Serving"): what is stored, what one request
    looks like, and how much memory the runtime keeps for itself."""

    weight_dtype: Literal["bf16", "fp8", "int4"] = Field(
        "bf16", description="the layers' matmul weights (seed: FP8 close to lossless, INT4 weight-only quarters memory); "
                            "embedding, head and norms stay bf16")
    kv_dtype: Literal["bf16", "fp8"] = Field("bf16", description="KV cache values (seed: an FP8 KV cache halves the cache)")
    tp: int | None = Field(None, ge=1, description="tensor-parallel GPUs per replica; default parallel.tp")
    prompt_len: int = Field(512, ge=1, description="prompt tokens per request (prefill)")
    output_len: int = Field(256, ge=1, description="generated tokens per request (decode)")
    prefill_mfu: float | None = Field(None, gt=0, le=1, description="utilisation of prefill; default estimate.mfu")
    memory_reserve: float = Field(
        0.1, ge=0, lt=1, description="share of GPU memory kept from the KV cache for the runtime, activations and "
                                     "fragmentation (vLLM's default gpu_memory_utilization 0.9 leaves 0.1)")
    allreduce_latency_s: float = Field(
        1e-5, ge=0, description="fixed cost of one small tensor-parallel all-reduce in decode (assumed ~10 us on NVLink); "
                                "bytes / bandwidth alone would make it free")


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
    gpu_memory_bandwidth: float = Field(3.35e12, gt=0, description="HBM bytes/s per GPU (H100 SXM: 3.35e12)")
    intra_node_bandwidth: float = Field(
        450e9, gt=0, description="bytes/s each way per GPU inside a node (seed: NVLink, about 450 GB/s per H100)")
    inter_node_bandwidth: float = Field(
        50e9, gt=0, description="bytes/s per GPU between nodes (seed: about 50 GB/s on 400 Gb/s InfiniBand)")
    attention_flops: Literal["full", "causal"] = Field(
        "full",
        description="full: count the whole s x s score matrix (PaLM/Megatron MFU convention, the seed's ~16 TFLOP, "
        "what torch's FLOP counter reports); causal: only the lower triangle that a causal kernel needs",
    )
    serve: ServeEstimateConfig = Field(default_factory=ServeEstimateConfig,
                                       description="the serving estimate: KV capacity, TTFT, TPOT by concurrency")
