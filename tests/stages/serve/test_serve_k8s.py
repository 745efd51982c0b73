"""The vLLM Deployment manifest renders as valid Kubernetes YAML with the expected fields."""

from __future__ import annotations

import pytest
import yaml

from stages.serve.k8s import VLLMDeployment, from_lifecycle_config, render_yaml


def test_vllm_deployment_renders_valid_yaml_with_tensor_parallel_gpus():
    from infra.config import load_config

    cfg = load_config("configs/seed-1b.yaml", [])
    d = from_lifecycle_config(cfg, "s3://artifacts/seed/export/abc123/hf", replicas=2, api_key_secret="serve-key",
                              kv_cache_dtype="fp8")
    docs = list(yaml.safe_load_all(render_yaml(d)))
    dep, svc = docs
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
