"""`serve:` what the serve stage measures on the exported model before it hands it over."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import Section


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
