"""Replicas behind a router: prefix-cache affinity, a canary share, per-model metrics."""

from __future__ import annotations

import httpx
import pytest

from stages.serve.server import ServerThread, build_app, build_router


@pytest.fixture(scope="module")
def canary_dir(tiny_hf_model_dir, tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("canary") / "canary-model"
    shutil.copytree(tiny_hf_model_dir, d)
    return d


def test_prefix_affinity_and_canary_share(tiny_hf_model_dir, canary_dir):
    router = build_router(str(tiny_hf_model_dir), replicas=3, canary_model_dir=str(canary_dir), canary_share=0.25,
                          num_kv_blocks=64)
    tok = router.primary.engine.tokenizer
    system = tok.encode("You are a helpful assistant that writes Python code only.\n" * 3)
    assert len(system) >= 32
    # requests sharing their first block land on the same primary replica (its prefix cache has it)
    chosen = {router._affine(system + tok.encode(q)) for q in ("a", "b", "def f():", "class X:")}
    assert len(chosen) == 1
    spread = {router._affine(tok.encode(f"{i} unrelated prompt number {i} " * 3)) for i in range(30)}
    assert len(spread) == 3  # different prefixes spread over the replicas
    # about a quarter of unnamed requests go to the canary; naming a model pins it
    picks = [router.choose(tok.encode(f"p{i}")) for i in range(800)]
    share = sum(p is router.canary for p in picks) / len(picks)
    assert 0.19 < share < 0.31
    assert router.choose([1, 2, 3], model="canary-model") is router.canary
    assert router.choose([1, 2, 3], model="target") is not router.canary
    with pytest.raises(LookupError):
        router.resolve_model("nope")


def test_router_serves_and_labels_metrics_per_model(tiny_hf_model_dir, canary_dir):
    router = build_router(str(tiny_hf_model_dir), replicas=2, canary_model_dir=str(canary_dir), canary_share=0.5,
                          num_kv_blocks=64)
    with ServerThread(build_app(router)) as srv:
        models = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
        assert models == ["target", "canary-model"]
        for i in range(12):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": f"x{i}", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"model": "canary-model", "prompt": "y", "max_tokens": 3})
        assert r.json()["model"] == "canary-model"
        text = httpx.get(srv.url + "/metrics").text
    router.shutdown()
    for model in ("target", "canary-model"):
        line = next(x for x in text.splitlines()
                    if x.startswith("vllm:e2e_request_latency_seconds_count") and f'model_name="{model}"' in x)
        assert float(line.split()[-1]) >= 1
