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


def _canary_config(*more):
    from infra.config import load_config

    return load_config("configs/seed-1b.yaml", ["serve.autoscale=null", "serve.variant=int4",
                                                 "serve.kv_cache_dtype=fp8", "serve.canary.share=0.1", *more])


def test_variant_uri_and_kv_cache_dtype_reach_the_container():
    from infra.config import load_config

    cfg = load_config("configs/tiny.yaml", ["serve.variant=int8", "serve.kv_cache_dtype=fp8", "serve.enforce_eager=true"])
    d = from_lifecycle_config(cfg, "s3://artifacts/tiny/export/abc123/quantized/int8")
    dep = _by_kind(render_yaml(d))["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"  # from serve.kv_cache_dtype, no override
    assert "--enforce-eager" in args  # from serve.enforce_eager
    # the init container syncs the variant's folder to where --model points
    sync = pod["initContainers"][0]["command"]
    assert sync[3:5] == ["s3://artifacts/tiny/export/abc123/quantized/int8/", "/models/int8/"]
    assert args[args.index("--model") + 1] == "/models/int8"
    # the default stays the unquantized hf/ and the model's own KV dtype
    d0 = from_lifecycle_config(load_config("configs/tiny.yaml"), "/data/export/hf")
    args0 = _by_kind(render_yaml(d0))["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args0[args0.index("--kv-cache-dtype") + 1] == "auto" and "--enforce-eager" not in args0
    assert args0[args0.index("--model") + 1] == "/data/export/hf"


def test_canary_renders_two_deployments_and_a_weighted_http_route():
    from kubernetes.client import ApiClient

    cfg = _canary_config("serve.canary.stable_model_uri=s3://a/seed/export/old/quantized/int4",
                         "serve.canary.replicas=2", "serve.canary.gateway=llm-gw")
    d = from_lifecycle_config(cfg, "s3://a/seed/export/new/quantized/int4", namespace="llm")
    docs = list(yaml.safe_load_all(render_yaml(d)))
    by = {(x["kind"], x["metadata"]["name"]): x for x in docs}
    assert len(by) == len(docs)
    name = d.name
    stable, canary = by[("Deployment", name)], by[("Deployment", f"{name}-canary")]
    s_svc, c_svc = by[("Service", name)], by[("Service", f"{name}-canary")]
    api = ApiClient()
    for obj, kind in ((stable, "V1Deployment"), (canary, "V1Deployment"), (s_svc, "V1Service"), (c_svc, "V1Service")):
        assert api.sanitize_for_serialization(api._ApiClient__deserialize(obj, kind)) == obj
    # the new export is the canary, the stable keeps the named model; each Service selects only its own pods
    def args(dep):
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    def synced(dep):
        return dep["spec"]["template"]["spec"]["initContainers"][0]["command"][3]

    assert synced(canary) == "s3://a/seed/export/new/quantized/int4/"
    assert synced(stable) == "s3://a/seed/export/old/quantized/int4/"
    assert canary["spec"]["replicas"] == 2 and stable["spec"]["replicas"] == 1
    assert c_svc["spec"]["selector"] == canary["spec"]["template"]["metadata"]["labels"] != s_svc["spec"]["selector"]
    assert s_svc["spec"]["selector"] == stable["spec"]["template"]["metadata"]["labels"]
    # same pod template apart from name, model and labels: the same flags and GPUs
    a_s, a_c = args(stable), args(canary)
    assert a_c[a_c.index("--kv-cache-dtype") + 1] == a_s[a_s.index("--kv-cache-dtype") + 1] == "fp8"
    assert a_c[a_c.index("--tensor-parallel-size") + 1] == a_s[a_s.index("--tensor-parallel-size") + 1]
    # the canary answers to the stable's model name, and its metrics carry its own (the first)
    i = a_c.index("--served-model-name")
    assert a_c[i + 1:i + 3] == [f"{name}-canary", a_s[a_s.index("--served-model-name") + 1]]
    # both are scraped, so Prometheus can compare them
    assert by[("PodMonitor", f"{name}-canary")]["spec"]["selector"]["matchLabels"] == c_svc["spec"]["selector"]
    assert by[("PodMonitor", name)]["spec"]["selector"]["matchLabels"] == s_svc["spec"]["selector"]
    # the Gateway API split: 10 of 100 to the canary's Service, 90 to the stable's
    route = by[("HTTPRoute", name)]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["metadata"]["namespace"] == "llm"
    assert route["spec"]["parentRefs"] == [{"name": "llm-gw"}]
    refs = {r["name"]: (r["weight"], r["port"]) for r in route["spec"]["rules"][0]["backendRefs"]}
    port = s_svc["spec"]["ports"][0]["port"]
    assert refs == {s_svc["metadata"]["name"]: (90, port), c_svc["metadata"]["name"]: (10, port)}
    # an odd share rounds to whole percent and the weights still sum to 100
    from stages.serve.k8s import Canary

    assert Canary(model_uri="/m", share=0.333).weights == (67, 33)


def test_bad_variant_and_canary_settings_are_config_errors_naming_the_field():
    from infra.config import ConfigError, load_config
    from stages.serve.k8s import Canary

    with pytest.raises(ConfigError, match=r"serve.variant = 'gguf-q4_0'.*vLLM serves safetensors"):
        load_config("configs/tiny.yaml", ["serve.variant=gguf-q4_0"])
    with pytest.raises(ConfigError, match=r"serve.variant=int4-awq is not exported: export.variants = \['fp8'\]"):
        load_config("configs/tiny.yaml", ["serve.variant=int4-awq", "export.variants=[fp8]"])
    with pytest.raises(ConfigError, match=r"serve.kv_cache_dtype = 'int8'"):
        load_config("configs/tiny.yaml", ["serve.kv_cache_dtype=int8"])
    for share in ("0", "1", "1.5", "0.001"):
        with pytest.raises(ConfigError, match=rf"serve.canary.share = {share}"):
            load_config("configs/tiny.yaml", [f"serve.canary.share={share}", "serve.canary.stable_model_uri=/m"])
    with pytest.raises(ConfigError, match=r"serve.canary.stable_model_uri: Field required"):
        load_config("configs/tiny.yaml", ["serve.canary.share=0.1"])
    with pytest.raises(ValueError, match="canary share must be in"):
        Canary(model_uri="/m", share=1.0)
    # "previous" is resolved by the stage (it knows the artifacts); rendering without it is refused
    with pytest.raises(ValueError, match="stable_model_uri is 'previous'"):
        from_lifecycle_config(_canary_config("serve.canary.stable_model_uri=previous"), "/m/quantized/int4")


def test_previous_export_is_the_stable_model_of_a_canary(tmp_path):
    from infra.artifacts import commit_artifact
    from infra.store import FileStore
    from stages.serve.stage import previous_export_uri

    store = FileStore(tmp_path / "store")

    def export(fp, variants):
        folder = tmp_path / fp
        for v in ["hf", *(f"quantized/{v}" for v in variants)]:
            (folder / v).mkdir(parents=True)
            (folder / v / "config.json").write_text("{}")
        return commit_artifact(store, "exp", "export", fp, folder, config={})

    with pytest.raises(FileNotFoundError, match="no export artifact older than"):
        previous_export_uri(store, "exp", export("a" * 16, ["int8"]).uri, "int8")
    old = store.url(f"exp/export/{'a' * 16}")
    middle = export("b" * 16, ["int4"])
    new = export("c" * 16, ["int8"])
    assert previous_export_uri(store, "exp", new.uri, "hf") == middle.uri.rstrip("/") + "/hf"
    assert previous_export_uri(store, "exp", middle.uri, "int8") == old.rstrip("/") + "/quantized/int8"
    with pytest.raises(FileNotFoundError, match=r"has no quantized/int8/"):
        previous_export_uri(store, "exp", new.uri, "int8")  # the previous one (middle) lacks it
