"""Scale-out (documented, not run here): a Kubernetes Deployment + Service running vLLM's
OpenAI-compatible server on the export stage's Hugging Face checkpoint, one pod per replica with
`tensor_parallel_size` GPUs each (seed: tensor parallelism within a node for latency, replicas for
throughput). The checkpoint is copied from object storage into the pod by an init container.

    kubectl apply -f vllm.yaml      # then: kubectl port-forward svc/<name> 8000:8000

The same clients (openai, lm-eval's local-completions, `eightfold bench serve --base-url`) work
against it, since both servers speak the same API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml


@dataclass
class VLLMDeployment:
    name: str
    """Deployment/Service name (DNS-1123: lowercase letters, digits, '-')."""
    model_uri: str
    """The exported `hf/` folder: s3://bucket/prefix (copied in by an init container) or a path in the pod."""
    tensor_parallel_size: int = 1
    """GPUs per replica, passed to vLLM's --tensor-parallel-size."""
    replicas: int = 1
    image: str = "vllm/vllm-openai:latest"
    served_model_name: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    """"auto" or "fp8" (halves the KV cache)."""
    api_key_secret: str | None = None
    """Name of a Secret with key `api-key`; vLLM then requires `Authorization: Bearer ...`."""
    s3_endpoint_url: str | None = None
    s3_credentials_secret: str | None = None
    """Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the init container."""
    namespace: str | None = None
    port: int = 8000
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.name):
            raise ValueError(f"name {self.name!r} is not a valid Kubernetes name (lowercase, digits, '-')")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")


def _model_path(d: VLLMDeployment) -> str:
    return "/models/hf" if d.model_uri.startswith("s3://") else d.model_uri


def render_manifests(d: VLLMDeployment) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/name": d.name, "app.kubernetes.io/component": "vllm-server"}
    args = ["--model", _model_path(d), "--host", "0.0.0.0", "--port", str(d.port),
            "--tensor-parallel-size", str(d.tensor_parallel_size),
            "--served-model-name", d.served_model_name or d.name,
            "--gpu-memory-utilization", str(d.gpu_memory_utilization),
            "--kv-cache-dtype", d.kv_cache_dtype]
    if d.enable_prefix_caching:
        args.append("--enable-prefix-caching")
    if d.max_model_len:
        args += ["--max-model-len", str(d.max_model_len)]
    args += d.extra_args
    env = []
    if d.api_key_secret:
        env.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": d.api_key_secret, "key": "api-key"}}})
    gpus = str(d.tensor_parallel_size)
    container = {
        "name": "vllm",
        "image": d.image,
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": d.port}],
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": d.port}, "initialDelaySeconds": 30, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/health", "port": d.port}, "initialDelaySeconds": 300, "periodSeconds": 30},
        "volumeMounts": [{"name": "models", "mountPath": "/models"}, {"name": "shm", "mountPath": "/dev/shm"}],
    }
    init = []
    if d.model_uri.startswith("s3://"):
        cmd = ["aws", "s3", "sync", d.model_uri.rstrip("/") + "/", "/models/hf/"]
        if d.s3_endpoint_url:
            cmd += ["--endpoint-url", d.s3_endpoint_url]
        init_c: dict[str, Any] = {"name": "fetch-checkpoint", "image": "amazon/aws-cli:latest", "command": cmd,
                                  "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
        if d.s3_credentials_secret:
            init_c["envFrom"] = [{"secretRef": {"name": d.s3_credentials_secret}}]
        init.append(init_c)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "models", "emptyDir": {}},
                    # tensor parallel workers exchange data through shared memory
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}],
    }
    if init:
        pod_spec["initContainers"] = init
    meta: dict[str, Any] = {"name": d.name, "labels": labels}
    if d.namespace:
        meta["namespace"] = d.namespace
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {"replicas": d.replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": dict(meta),
        "spec": {"selector": labels, "ports": [{"name": "http", "port": d.port, "targetPort": "http"}]},
    }
    return [deployment, service]


def render_yaml(d: VLLMDeployment) -> str:
    return yaml.safe_dump_all(render_manifests(d), sort_keys=False)


def from_lifecycle_config(cfg, model_uri: str, **overrides) -> VLLMDeployment:
    """Tensor parallel size from the config's `parallel.tp` (the layout the model was trained with
    fits its heads: n_heads and n_kv_heads divide by it, as vLLM requires)."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-") or "eightfold"
    kw = {"name": name, "model_uri": model_uri, "tensor_parallel_size": cfg.parallel.tp,
          "max_model_len": cfg.model.max_seq_len, "s3_endpoint_url": cfg.infra.s3_endpoint_url}
    kw.update(overrides)
    return VLLMDeployment(**kw)
