"""`serve:` what the serve stage measures on the exported model before it hands it over."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import Section
from .export import VARIANTS

# The export's variants vLLM loads: compressed-tensors safetensors folders. The gguf-* variants are one
# llama.cpp file each, which vLLM does not serve as a checkpoint (`eightfold serve` runs them locally).
VLLM_VARIANTS = ("hf", *(v for v in VARIANTS if not v.startswith("gguf-")))


class AutoscaleConfig(Section):
    """`serve.autoscale:` a HorizontalPodAutoscaler for the vLLM Deployment in `vllm.yaml`, on the
    per-pod queue depth and KV-cache use vLLM exports (seed: autoscale on queue depth and KV-cache
    use; stages/serve/k8s.py renders it). The HPA adds a replica when either average is over its
    target."""

    min_replicas: int = Field(1, ge=1, description="replicas kept however idle")
    max_replicas: int = Field(4, ge=1, description="the most replicas (GPUs: max_replicas * parallel.tp)")
    target_waiting_requests: float = Field(5.0, ge=0.001, allow_inf_nan=False,
                                           description="average vllm:num_requests_waiting per pod")
    target_kv_cache_usage: float = Field(0.8, ge=0.001, le=1, description="average vllm:kv_cache_usage_perc per pod "
                                                                          "(a fraction: 1 is a full KV cache)")
    scale_down_stabilization_s: int = Field(300, ge=0, description="how long load must stay low before a "
                                                                   "replica is removed (pods take minutes to load)")

    @model_validator(mode="after")
    def _range(self) -> "AutoscaleConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self


class CanaryConfig(Section):
    """`serve.canary:` roll the new export out to a slice of traffic first (seed: new checkpoints go
    out as a canary). vllm.yaml then runs two Deployments: the stable one (the config's name) on
    `stable_model_uri`, and `<name>-canary` on this export, with a Gateway API HTTPRoute splitting
    requests between their Services by `share`. Promote by dropping `serve.canary` (the stable
    Deployment then serves this export); roll back by deleting the canary objects."""

    share: float = Field(..., gt=0, lt=1, description="fraction of requests sent to the canary (the new "
                                                      "export), in whole percent: 0.01 to 0.99")
    stable_model_uri: str = Field(..., min_length=1, description="the model the stable Deployment keeps "
                                  "serving: 'previous' (the newest earlier export artifact of this experiment, "
                                  "same serve.variant) or the model folder's URI (s3://... or a path in the pod)")
    replicas: int = Field(1, ge=1, description="canary pods (the HPA, if any, scales the stable Deployment only)")
    gateway: str = Field("inference-gateway", min_length=1,
                         description="the Gateway (gateway.networking.k8s.io) the HTTPRoute attaches to")

    @field_validator("share")
    @classmethod
    def _whole_percent(cls, v: float) -> float:
        if not 1 <= round(v * 100) <= 99:
            raise ValueError(f"share {v} rounds to {round(v * 100)}% of requests: the HTTPRoute weighs "
                             "backends in whole percent, so use 0.01 to 0.99")
        return v


class ServeConfig(Section):
    """A short load test through the real HTTP server (like `eightfold bench serve`), so the stage's
    artifact, MLflow and the report carry serving latency: TTFT, TPOT, ITL, end to end."""

    load_requests: int = Field(32, ge=0, description="requests of the load test; 0 skips it")
    load_concurrency: int = Field(8, ge=1, description="requests in flight at once")
    load_input_len: int = Field(64, ge=1, description="prompt tokens per request (±25%; both lengths shrink to fit "
                                                     "the model's context)")
    load_output_len: int = Field(32, ge=1, description="generated tokens per request (±25%)")
    threads: int | None = Field(None, ge=1, description="the server's torch threads (default: torch's)")
    slo_ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False, description="p99 time-to-first-token "
                                      "objective: an alert in vllm.yaml, and goodput in the load test")
    slo_tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False,
                                      description="p99 time-per-output-token objective (as slo_ttft_ms)")
    autoscale: AutoscaleConfig | None = Field(None, description="an HPA on queue depth and KV-cache use in "
                                                                "vllm.yaml; absent: a fixed replica count")
    variant: str = Field("hf", description="what vllm.yaml deploys and the load test serves: hf (unquantized) "
                         f"or a variant in export.variants that vLLM loads ({', '.join(VLLM_VARIANTS[1:])})")
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description="KV cache dtype, in vllm.yaml "
                                                   "(--kv-cache-dtype) and the load test's engine; fp8 halves it")
    enforce_eager: bool = Field(False, description="vLLM's --enforce-eager, in vllm.yaml and the load test's server: "
                                "no compiled step (no CUDA graphs on GPU), so no start-up compile")
    canary: CanaryConfig | None = Field(None, description="deploy this export as a canary on a share of traffic; "
                                                          "absent: one Deployment")

    @field_validator("variant")
    @classmethod
    def _vllm_loads_it(cls, v: str) -> str:
        if v.startswith("gguf-") and v in VARIANTS:
            raise ValueError(f"{v} is a llama.cpp GGUF file and vLLM serves safetensors checkpoints: use one of "
                             f"{', '.join(VLLM_VARIANTS)} (run GGUF locally: eightfold serve <export>/quantized/{v})")
        if v not in VLLM_VARIANTS:
            raise ValueError(f"unknown variant {v!r}; vLLM can serve {', '.join(VLLM_VARIANTS)}")
        return v
