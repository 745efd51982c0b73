"""The vLLM Deployment manifest renders as valid Kubernetes YAML with the expected fields."""

from __future__ import annotations

import pytest
import yaml

from stages.serve.k8s import VLLMDeployment, from_lifecycle_config, render_yaml


def test_vllm_deployment_renders_valid_yaml_with_tensor_parallel_gpus():
    from infra.config import load_config

    cfg = load_config("configs/seed-1b.yaml", ["serve.autoscale=null"])  # a fixed replica count
    d = from_lifecycle_config(cfg, "s3://artifacts/seed/export/abc123/hf", replicas=2, api_key_secret="serve-key",
                              kv_cache_dtype="fp8")
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(render_yaml(d))}
    assert "HorizontalPodAutoscaler" not in docs and "PrometheusRule" in docs  # seed-1b sets SLOs
    dep, svc = docs["Deployment"], docs["Service"]
    assert dep["apiVersion"] == "apps/v1" and dep["kind"] == "Deployment" and svc["kind"] == "Service"
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = c["args"]
    tp = cfg.parallel.tp
    assert args[args.index("--tensor-parallel-size") + 1] == str(tp)
    assert args[args.index("--model") + 1] == "/models/hf"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8" and "--enable-prefix-caching" in args
    assert args[args.index("--max-model-len") + 1] == str(cfg.model.max_seq_len)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(tp)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "serve-key"
    assert pod["initContainers"][0]["command"][:4] == ["aws", "s3", "sync", "s3://artifacts/seed/export/abc123/hf/"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    # the kubernetes client's own models accept it (field names and types)
    from kubernetes.client import ApiClient

    api = ApiClient()
    obj = api._ApiClient__deserialize(dep, "V1Deployment")
    assert obj.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == str(tp)
    api._ApiClient__deserialize(svc, "V1Service")


def test_bad_deployment_values_are_named():
    with pytest.raises(ValueError, match="valid Kubernetes name"):
        VLLMDeployment(name="Bad_Name", model_uri="/m")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMDeployment(name="ok", model_uri="/m", tensor_parallel_size=0)


def _by_kind(text: str) -> dict:
    docs = list(yaml.safe_load_all(text))
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs)
    return by_kind


def test_autoscaling_and_slo_alerts_render_from_the_serve_config():
    import re
    from decimal import Decimal

    from kubernetes.client import ApiClient
    from kubernetes.utils import parse_quantity

    from infra.config import load_config
    from stages.serve.k8s import render_adapter_rules

    cfg = load_config("configs/seed-1b.yaml", [
        "serve.autoscale.min_replicas=2", "serve.autoscale.max_replicas=6", "serve.autoscale.target_kv_cache_usage=0.75",
        "serve.autoscale.target_waiting_requests=2.5", "serve.slo_ttft_ms=500", "serve.slo_tpot_ms=50"])
    d = from_lifecycle_config(cfg, "s3://artifacts/seed/export/abc123/hf", namespace="llm")
    k = _by_kind(render_yaml(d))
    assert set(k) == {"Deployment", "Service", "PodMonitor", "HorizontalPodAutoscaler", "PrometheusRule"}
    dep, hpa, mon, rule = k["Deployment"], k["HorizontalPodAutoscaler"], k["PodMonitor"], k["PrometheusRule"]
    assert "replicas" not in dep["spec"]  # the HPA owns the count; an apply must not reset it
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": dep["apiVersion"], "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["metadata"]["namespace"] == dep["metadata"]["namespace"] == "llm"
    # the kubernetes client's models as the reference: every field survives a round trip through
    # V2HorizontalPodAutoscaler (a misspelt or misplaced key would be dropped), required ones present
    api = ApiClient()
    obj = api._ApiClient__deserialize(hpa, "V2HorizontalPodAutoscaler")
    assert api.sanitize_for_serialization(obj) == hpa
    assert api.sanitize_for_serialization(api._ApiClient__deserialize(dep, "V1Deployment")) == dep
    targets = {m.pods.metric.name: parse_quantity(m.pods.target.average_value) for m in obj.spec.metrics
               if m.type == "Pods" and m.pods.target.type == "AverageValue"}
    assert targets == {"vllm_num_requests_waiting": Decimal("2.5"), "vllm_kv_cache_usage_perc": Decimal("0.75")}
    assert obj.spec.behavior.scale_down.stabilization_window_seconds == 300
    # prometheus-adapter publishes exactly those names from vLLM's series, per namespace/pod
    rules = yaml.safe_load(render_adapter_rules(d)["data"]["config.yaml"])["rules"]
    published = {}
    for r in rules:
        series = r["seriesQuery"].split("{")[0]
        assert re.fullmatch(r["name"]["matches"], series)
        published[re.sub(r["name"]["matches"], r["name"]["as"], series)] = series
        assert r["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.LabelMatchers>>" in r["metricsQuery"] and "by (<<.GroupBy>>)" in r["metricsQuery"]
    assert published == {"vllm_num_requests_waiting": "vllm:num_requests_waiting",
                         "vllm_kv_cache_usage_perc": "vllm:kv_cache_usage_perc"}
    # Prometheus scrapes the Deployment's pods on the container's named port
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert mon["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    port = mon["spec"]["podMetricsEndpoints"][0]
    assert port["path"] == "/metrics" and port["port"] in {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    # p99 of vLLM's TTFT and per-request TPOT histograms over 5 minutes, against the objectives in seconds
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    exprs = [r["expr"] for r in rule["spec"]["groups"][0]["rules"]]
    pattern = r"histogram_quantile\(0\.99, sum by \(le\) \(rate\((\S+)_bucket\{(.*)\}\[5m\]\)\)\) > (\S+)"
    got = {m[1]: (float(m[3]), m[2]) for m in (re.fullmatch(pattern, e) for e in exprs)}
    served = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    sel = f'model_name="{served[served.index("--served-model-name") + 1]}",namespace="llm"'
    assert got == {"vllm:time_to_first_token_seconds": (0.5, sel),
                   "vllm:request_time_per_output_token_seconds": (0.05, sel)}


def test_operating_objects_are_off_unless_configured(tmp_path):
    from infra.config import load_config
    from stages.serve.k8s import Autoscaling, write_manifests

    d = from_lifecycle_config(load_config("configs/tiny.yaml", ["serve.slo_ttft_ms=null", "serve.slo_tpot_ms=null"]),
                              "/models/hf")
    assert d.autoscaling is None and d.slo_ttft_ms is None
    assert set(_by_kind(render_yaml(d))) == {"Deployment", "Service"}
    assert set(write_manifests(d, tmp_path / "a")) == {"vllm.yaml"}
    # an SLO alone: the alert and the scrape it needs, no autoscaler
    only_slo = VLLMDeployment(name="m", model_uri="/m", slo_tpot_ms=50)
    k = _by_kind(render_yaml(only_slo))
    assert set(k) == {"Deployment", "Service", "PodMonitor", "PrometheusRule"} and k["Deployment"]["spec"]["replicas"] == 1
    assert len(k["PrometheusRule"]["spec"]["groups"][0]["rules"]) == 1
    files = write_manifests(VLLMDeployment(name="m", model_uri="/m", autoscaling=Autoscaling()), tmp_path / "b")
    cm = yaml.safe_load(files["prometheus-adapter.yaml"].read_text())  # the header is a YAML comment
    assert cm["kind"] == "ConfigMap" and "rules" in yaml.safe_load(cm["data"]["config.yaml"])


def test_bad_autoscaling_and_slo_settings_are_named():
    from infra.config import ConfigError, load_config
    from stages.serve.k8s import Autoscaling

    with pytest.raises(ValueError, match=r"max_replicas \(2\) must be >= min_replicas \(3\)"):
        Autoscaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_kv_cache_usage is a fraction"):
        Autoscaling(target_kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="target_waiting_requests must be > 0"):
        Autoscaling(target_waiting_requests=0)
    with pytest.raises(ValueError, match="slo_ttft_ms must be a positive number"):
        VLLMDeployment(name="ok", model_uri="/m", slo_ttft_ms=0)
    with pytest.raises(ValueError, match="slo_alert_for"):
        VLLMDeployment(name="ok", model_uri="/m", slo_tpot_ms=50, slo_alert_for="10 minutes")
    with pytest.raises(ConfigError, match=r"serve.autoscale: min_replicas \(4\) must be <= max_replicas \(2\)"):
        load_config("configs/tiny.yaml", ["serve.autoscale.min_replicas=4", "serve.autoscale.max_replicas=2"])
    with pytest.raises(ConfigError, match="serve.slo_ttft_ms = -1"):
        load_config("configs/tiny.yaml", ["serve.slo_ttft_ms=-1"])
    with pytest.raises(ConfigError, match="serve.autoscale.target_kv_cache_usage = 2"):
        load_config("configs/tiny.yaml", ["serve.autoscale.target_kv_cache_usage=2"])
