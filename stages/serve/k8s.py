"""Scale-out (documented, not run here): a Kubernetes Deployment + Service running vLLM's
OpenAI-compatible server on the export stage's Hugging Face checkpoint, one pod per replica with
`tensor_parallel_size` GPUs each (seed: tensor parallelism within a node for latency, replicas for
throughput). The checkpoint is copied from object storage into the pod by an init container.

    kubectl apply -f vllm.yaml      # then: kubectl port-forward svc/<name> 8000:8000

The same clients (openai, lm-eval's local-completions, `eightfold bench serve --base-url`) work
against it, since both servers speak the same API.

Operating it (seed: SLOs on TTFT and TPOT percentiles, autoscale on queue depth and KV-cache use),
all optional and off unless configured (`serve.autoscale`, `serve.slo_ttft_ms`, `serve.slo_tpot_ms`):

- `autoscale`: an `autoscaling/v2` HorizontalPodAutoscaler on two per-pod custom metrics from
  vLLM's Prometheus endpoint (`/metrics` on the serving port): `vllm:num_requests_waiting` (queue
  depth) and `vllm:kv_cache_usage_perc` (KV-cache use, a fraction; vLLM's name since 2025, when it
  replaced `vllm:gpu_cache_usage_perc`, vllm-project/vllm#18354, which current vLLM no longer
  exports by default). The HPA keeps each average under its target and removes replicas slowly
  (pods take minutes to load a model). The Deployment then leaves `replicas` to the HPA.
  The HPA reads the custom metrics API, which prometheus-adapter serves from Prometheus:
  `prometheus-adapter.yaml` holds the adapter rules (merge them into the adapter's config, e.g.
  the Helm chart's `rules.custom`), which publish `vllm:<name>` as `vllm_<name>` per pod, and
  `vllm.yaml` a PodMonitor (prometheus-operator) that has Prometheus scrape the pods with their
  `namespace` and `pod` labels. Alternative without the adapter: KEDA, a ScaledObject on the
  Deployment with two `prometheus` triggers, `sum(vllm:num_requests_waiting{model_name="NAME"})`
  and `avg(vllm:kv_cache_usage_perc{model_name="NAME"})`, thresholds as here (KEDA makes the HPA).
- `slo_ttft_ms` / `slo_tpot_ms`: a PrometheusRule alerting when p99 TTFT or TPOT over the last 5
  minutes, `histogram_quantile(0.99, sum by (le) (rate(<histogram>_bucket[5m])))` across the
  replicas, stays over its objective: histograms `vllm:time_to_first_token_seconds` and
  `vllm:request_time_per_output_token_seconds` (TPOT per request, what `bench serve` calls TPOT;
  `vllm:inter_token_latency_seconds` is the gap between streamed chunks, which vLLM called
  `vllm:time_per_output_token_seconds` before 0.11). The quantile interpolates within vLLM's
  buckets, so an objective on a bucket bound (e.g. 100, 250, 500 ms TTFT; 25, 50, 100 ms TPOT) is
  checked exactly: the alert's condition holds iff over 1% of requests took longer.
  `eightfold bench serve --goodput ttft:MS tpot:MS` measures the same objectives from the client.

What it serves: `serve.variant` picks the export's folder, `hf/` or `quantized/<variant>/` (fp8,
int8, int4, int4-awq: compressed-tensors safetensors, which vLLM detects from the folder's
`quantization_config`; the gguf-* files are not vLLM checkpoints and are refused at config load), and
`serve.kv_cache_dtype` sets `--kv-cache-dtype` (fp8 halves the KV cache, so twice the tokens fit).

Canary rollout (`serve.canary`, off unless configured; seed: roll new checkpoints out as a canary to
a slice of traffic first): the stable Deployment (the config's name) keeps serving
`serve.canary.stable_model_uri` ("previous": the newest earlier export artifact), a second
Deployment `<name>-canary` (same pod template, its own labels, Service and replica count) serves the
new export, and a Gateway API `HTTPRoute` (gateway.networking.k8s.io/v1) attached to
`serve.canary.gateway` splits requests between the two Services by weight (`share` in whole
percent: 0.1 -> 10 canary, 90 stable). That needs a Gateway API implementation in the cluster
(Envoy Gateway, Istio, Cilium, kgateway, ...) and a Gateway; clients call the Gateway's address
rather than a Service. Both Deployments answer to the stable served model name, so clients do not
change, but the canary lists `<name>-canary` first in `--served-model-name`, which vLLM uses as the
`model_name` label of its metrics: Prometheus (a PodMonitor per Deployment) then compares the two,
e.g. `histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket[5m])))`
or error rates from `vllm:request_success_total` by `finished_reason`. Promote by dropping
`serve.canary` and re-rendering (the stable Deployment then rolls to the new export); roll back by
deleting the canary's objects. The HPA and SLO alerts stay on the stable Deployment.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml


# vLLM's Prometheus names (current releases); see the module docstring for the renamed ones.
QUEUE_METRIC = "vllm:num_requests_waiting"
KV_CACHE_METRIC = "vllm:kv_cache_usage_perc"
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
TPOT_HISTOGRAM = "vllm:request_time_per_output_token_seconds"


def custom_metric_name(prometheus_name: str) -> str:
    """The custom-metrics API name prometheus-adapter publishes for a vLLM series (':' is not
    allowed there): `vllm:num_requests_waiting` -> `vllm_num_requests_waiting`."""
    return prometheus_name.replace(":", "_", 1)


@dataclass
class Autoscaling:
    """The HPA's range and targets (per-pod averages it holds; see ServeConfig.autoscale)."""
    min_replicas: int = 1
    max_replicas: int = 4
    target_waiting_requests: float = 5.0
    """Average `vllm:num_requests_waiting` per pod: requests queued because the batch is full."""
    target_kv_cache_usage: float = 0.8
    """Average `vllm:kv_cache_usage_perc` per pod (1 = full: new requests wait or preempt others)."""
    scale_down_stabilization_s: int = 300

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"autoscaling min_replicas must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling max_replicas ({self.max_replicas}) must be >= min_replicas "
                             f"({self.min_replicas})")
        if not (math.isfinite(self.target_waiting_requests) and self.target_waiting_requests >= 0.001):
            raise ValueError(f"autoscaling target_waiting_requests must be > 0 (at least 0.001), "
                             f"got {self.target_waiting_requests}")
        if not 0.001 <= self.target_kv_cache_usage <= 1:
            raise ValueError(f"autoscaling target_kv_cache_usage is a fraction in (0, 1], got {self.target_kv_cache_usage}")
        if self.scale_down_stabilization_s < 0:
            raise ValueError(f"autoscaling scale_down_stabilization_s must be >= 0, got {self.scale_down_stabilization_s}")


def _quantity(x: float) -> str:
    """A Kubernetes quantity for an HPA target: whole numbers plain, the rest in thousandths."""
    return str(int(x)) if float(x).is_integer() else f"{round(x * 1000)}m"


@dataclass
class Canary:
    """The new checkpoint on a slice of traffic, beside the stable Deployment (see the docstring)."""
    model_uri: str
    share: float
    """Fraction of requests routed to the canary, whole percent (0.01..0.99)."""
    replicas: int = 1
    gateway: str = "inference-gateway"
    """The Gateway the HTTPRoute attaches to (parentRefs)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.share, (int, float)) and 0 < self.share < 1 and 1 <= round(self.share * 100) <= 99):
            raise ValueError(f"canary share must be in (0, 1) in whole percent (0.01..0.99), got {self.share!r}")
        if self.replicas < 1:
            raise ValueError(f"canary replicas must be >= 1, got {self.replicas}")
        if not self.model_uri:
            raise ValueError("canary model_uri is empty")

    @property
    def weights(self) -> tuple[int, int]:
        """(stable, canary) HTTPRoute weights out of 100."""
        canary = round(self.share * 100)
        return 100 - canary, canary


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
    served_model_aliases: list[str] = field(default_factory=list)
    """More names the server answers to (the canary answers to the stable name too)."""
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    """"auto" or "fp8" (halves the KV cache)."""
    enforce_eager: bool = False
    """vLLM's --enforce-eager: no CUDA graphs or compiled step."""
    api_key_secret: str | None = None
    """Name of a Secret with key `api-key`; vLLM then requires `Authorization: Bearer ...`."""
    s3_endpoint_url: str | None = None
    s3_credentials_secret: str | None = None
    """Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the init container."""
    namespace: str | None = None
    port: int = 8000
    extra_args: list[str] = field(default_factory=list)
    autoscaling: Autoscaling | None = None
    """An HPA on queue depth and KV-cache use (plus the PodMonitor and adapter rules it needs)."""
    slo_ttft_ms: float | None = None
    """Alert when p`slo_quantile` TTFT stays over this (a PrometheusRule)."""
    slo_tpot_ms: float | None = None
    slo_quantile: float = 0.99
    slo_alert_for: str = "10m"
    """How long the objective must be missed before the alert fires."""
    canary: Canary | None = None
    """A second Deployment on `canary.model_uri` taking `canary.share` of requests (an HTTPRoute);
    `model_uri` is then the stable model."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.name):
            raise ValueError(f"name {self.name!r} is not a valid Kubernetes name (lowercase, digits, '-')")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        for key in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{key} must be a positive number of milliseconds, got {v!r}")
        if not 0 < self.slo_quantile < 1:
            raise ValueError(f"slo_quantile must be in (0, 1), e.g. 0.99; got {self.slo_quantile}")
        if not re.fullmatch(r"\d+[smh]", self.slo_alert_for):
            raise ValueError(f"slo_alert_for {self.slo_alert_for!r} must be a duration such as 5m, 300s, 1h")


def _model_path(d: VLLMDeployment) -> str:
    """Where the init container puts an s3:// model in the pod: /models/<last folder name>
    (`.../hf` -> /models/hf, `.../quantized/int4` -> /models/int4)."""
    if not d.model_uri.startswith("s3://"):
        return d.model_uri
    leaf = re.sub(r"[^A-Za-z0-9._-]+", "-", d.model_uri.rstrip("/").rsplit("/", 1)[-1]) or "model"
    return f"/models/{leaf}"


def canary_deployment(d: VLLMDeployment) -> VLLMDeployment:
    """The canary: the stable's pod template on the canary's model, its own name (so its own labels,
    selector and Service), its replica count; it answers to the stable's model name too, and reports
    metrics under its own."""
    c = d.canary
    assert c is not None
    name = f"{d.name}-canary"
    return replace(d, name=name, model_uri=c.model_uri, replicas=c.replicas, served_model_name=name,
                   served_model_aliases=[d.served_model_name or d.name, *d.served_model_aliases],
                   autoscaling=None, slo_ttft_ms=None, slo_tpot_ms=None, canary=None)


def render_http_route(d: VLLMDeployment) -> dict[str, Any]:
    """Gateway API weighted split between the stable and the canary Services (weights out of 100)."""
    c = d.canary
    assert c is not None
    stable_w, canary_w = c.weights
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": _meta(d, d.name),
            "spec": {"parentRefs": [{"name": c.gateway}],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                                "backendRefs": [{"name": d.name, "port": d.port, "weight": stable_w},
                                                {"name": f"{d.name}-canary", "port": d.port, "weight": canary_w}]}]}}


def render_manifests(d: VLLMDeployment) -> list[dict[str, Any]]:
    """The stable Deployment and Service (+ PodMonitor, HPA, PrometheusRule as configured); with a
    canary also its Deployment, Service, PodMonitor and the HTTPRoute splitting traffic."""
    out = _render_one(d)
    if d.canary:
        canary = canary_deployment(d)
        out += [*_render_one(canary), render_pod_monitor(canary), render_http_route(d)]
    return out


def _render_one(d: VLLMDeployment) -> list[dict[str, Any]]:
    labels = _labels(d)
    args = ["--model", _model_path(d), "--host", "0.0.0.0", "--port", str(d.port),
            "--tensor-parallel-size", str(d.tensor_parallel_size),
            "--served-model-name", d.served_model_name or d.name, *d.served_model_aliases,
            "--gpu-memory-utilization", str(d.gpu_memory_utilization),
            "--kv-cache-dtype", d.kv_cache_dtype]
    if d.enable_prefix_caching:
        args.append("--enable-prefix-caching")
    if d.enforce_eager:
        args.append("--enforce-eager")
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
        cmd = ["aws", "s3", "sync", d.model_uri.rstrip("/") + "/", _model_path(d) + "/"]
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
    meta = _meta(d, d.name)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {"replicas": d.replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
    }
    if d.autoscaling:  # the HPA owns the count: a replicas field would reset it on every apply
        del deployment["spec"]["replicas"]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": dict(meta),
        "spec": {"selector": labels, "ports": [{"name": "http", "port": d.port, "targetPort": "http"}]},
    }
    out = [deployment, service]
    if d.autoscaling or d.slo_ttft_ms or d.slo_tpot_ms or d.canary:  # a canary is judged on its metrics
        out.append(render_pod_monitor(d))
    if d.autoscaling:
        out.append(render_hpa(d))
    if d.slo_ttft_ms or d.slo_tpot_ms:
        out.append(render_slo_rules(d))
    return out


def _labels(d: VLLMDeployment) -> dict[str, str]:
    return {"app.kubernetes.io/name": d.name, "app.kubernetes.io/component": "vllm-server"}


def _meta(d: VLLMDeployment, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": _labels(d)}
    if d.namespace:
        meta["namespace"] = d.namespace
    return meta


def render_pod_monitor(d: VLLMDeployment) -> dict[str, Any]:
    """Prometheus (prometheus-operator) scrapes each vLLM pod's /metrics; the series carry the
    `namespace` and `pod` labels the adapter rules map to Kubernetes objects."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": _meta(d, d.name),
            "spec": {"selector": {"matchLabels": _labels(d)},
                     "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}


def render_hpa(d: VLLMDeployment) -> dict[str, Any]:
    """autoscaling/v2 on two per-pod averages: the HPA takes the larger replica count the two ask for."""
    a = d.autoscaling
    assert a is not None

    def pods_metric(prometheus_name: str, target: float) -> dict[str, Any]:
        return {"type": "Pods", "pods": {"metric": {"name": custom_metric_name(prometheus_name)},
                                         "target": {"type": "AverageValue", "averageValue": _quantity(target)}}}

    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(d, d.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": d.name},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [pods_metric(QUEUE_METRIC, a.target_waiting_requests),
                        pods_metric(KV_CACHE_METRIC, a.target_kv_cache_usage)],
            # scale up at the HPA's default pace; down one pod a minute once load has stayed low
            # for the window, since each replica removed drops its KV cache and takes minutes to return
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_s,
                                       "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}},
        },
    }


def render_adapter_rules(d: VLLMDeployment) -> dict[str, Any]:
    """prometheus-adapter discovery rules for the HPA's two metrics, as a ConfigMap whose
    `config.yaml` is the adapter's config format: per pod, the queue summed and the KV-cache use
    of the fullest engine (a pod runs one engine unless vLLM's data parallelism is on)."""
    rules = [{"seriesQuery": f'{metric}{{namespace!="",pod!=""}}',
              "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
              "name": {"matches": f"^{metric}$", "as": custom_metric_name(metric)},
              "metricsQuery": f"{agg}(<<.Series>>{{<<.LabelMatchers>>}}) by (<<.GroupBy>>)"}
             for metric, agg in ((QUEUE_METRIC, "sum"), (KV_CACHE_METRIC, "max"))]
    meta = _meta(d, f"{d.name}-prometheus-adapter-rules")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {"config.yaml": yaml.safe_dump({"rules": rules}, sort_keys=False)}}


def slo_expr(d: VLLMDeployment, histogram: str, slo_ms: float) -> str:
    """p`slo_quantile` across the replicas over 5 minutes, over the objective (seconds)."""
    sel = f'model_name="{d.served_model_name or d.name}"'
    if d.namespace:
        sel += f',namespace="{d.namespace}"'
    return (f"histogram_quantile({d.slo_quantile:g}, sum by (le) (rate({histogram}_bucket{{{sel}}}[5m])))"
            f" > {slo_ms / 1000:g}")


def render_slo_rules(d: VLLMDeployment) -> dict[str, Any]:
    pct = f"p{d.slo_quantile * 100:g}"
    rules = []
    for what, histogram, slo in (("TimeToFirstToken", TTFT_HISTOGRAM, d.slo_ttft_ms),
                                 ("TimePerOutputToken", TPOT_HISTOGRAM, d.slo_tpot_ms)):
        if slo:
            rules.append({
                "alert": f"VLLM{what}{pct.upper().replace('.', '_')}OverSLO",
                "expr": slo_expr(d, histogram, slo),
                "for": d.slo_alert_for,
                "labels": {"severity": "warning", "service": d.name},
                "annotations": {
                    "summary": f"{d.name}: {pct} {what} over its {slo:g} ms objective",
                    "description": f"{pct} of {histogram} over 5m is {{{{ $value | humanizeDuration }}}}, "
                                   f"objective {slo:g} ms (for {d.slo_alert_for}).",
                },
            })
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": _meta(d, f"{d.name}-slo"),
            "spec": {"groups": [{"name": f"{d.name}-slo", "rules": rules}]}}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the adapter's config.yaml) as `|` blocks; long PromQL on one line."""


_Dumper.add_representer(str, lambda dumper, s: dumper.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def render_yaml(d: VLLMDeployment) -> str:
    return yaml.dump_all(render_manifests(d), Dumper=_Dumper, sort_keys=False, width=4096)


ADAPTER_HEADER = """\
# prometheus-adapter rules that publish vLLM's queue depth and KV-cache use per pod to the custom
# metrics API, for the HorizontalPodAutoscaler in vllm.yaml. Merge the rules under config.yaml
# into your adapter's config (Helm chart prometheus-community/prometheus-adapter: values
# `rules.custom`) rather than applying this ConfigMap as is. Check with:
#   kubectl get --raw /apis/custom.metrics.k8s.io/v1beta1/namespaces/NS/pods/*/vllm_num_requests_waiting
"""


def write_manifests(d: VLLMDeployment, out_dir) -> dict[str, Path]:
    """`vllm.yaml` (apply as is) and, with autoscaling, `prometheus-adapter.yaml` (to merge)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"vllm.yaml": out_dir / "vllm.yaml"}
    files["vllm.yaml"].write_text(render_yaml(d))
    if d.autoscaling:
        files["prometheus-adapter.yaml"] = out_dir / "prometheus-adapter.yaml"
        files["prometheus-adapter.yaml"].write_text(
            ADAPTER_HEADER + yaml.dump(render_adapter_rules(d), Dumper=_Dumper, sort_keys=False, width=4096))
    return files


def from_lifecycle_config(cfg, model_uri: str, stable_model_uri: str | None = None, **overrides) -> VLLMDeployment:
    """Tensor parallel size from the config's `parallel.tp` (the layout the model was trained with
    fits its heads: n_heads and n_kv_heads divide by it, as vLLM requires); autoscaling and the
    SLO alerts from `serve.autoscale`, `serve.slo_ttft_ms`, `serve.slo_tpot_ms`; `--kv-cache-dtype`
    from `serve.kv_cache_dtype`; `--enforce-eager` from `serve.enforce_eager`. `model_uri` is the export's folder being deployed (the caller picks
    `serve.variant`'s). With `serve.canary` it becomes the canary and the stable Deployment serves
    `stable_model_uri` (given, or `serve.canary.stable_model_uri` unless that is "previous", which
    only the caller can resolve)."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-") or "eightfold"
    sc = cfg.serve
    kw = {"name": name, "model_uri": model_uri, "tensor_parallel_size": cfg.parallel.tp,
          "max_model_len": cfg.model.max_seq_len, "s3_endpoint_url": cfg.infra.s3_endpoint_url,
          "autoscaling": Autoscaling(**sc.autoscale.model_dump()) if sc.autoscale else None,
          "slo_ttft_ms": sc.slo_ttft_ms, "slo_tpot_ms": sc.slo_tpot_ms, "kv_cache_dtype": sc.kv_cache_dtype,
          "enforce_eager": sc.enforce_eager}
    if sc.canary:
        stable = stable_model_uri or (None if sc.canary.stable_model_uri == "previous" else sc.canary.stable_model_uri)
        if not stable:
            raise ValueError("serve.canary.stable_model_uri is 'previous': resolve it to the previous export's URI "
                             "(stable_model_uri=...) before rendering")
        kw["model_uri"] = stable
        kw["canary"] = Canary(model_uri=model_uri, share=sc.canary.share, replicas=sc.canary.replicas,
                              gateway=sc.canary.gateway)
    kw.update(overrides)
    return VLLMDeployment(**kw)
