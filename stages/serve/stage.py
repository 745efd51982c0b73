"""The serve stage of the lifecycle: check that the exported checkpoint serves (load it in the
engine, generate, compare the engine's greedy tokens with transformers' on the same prompt) and
write what it takes to run it: `vllm.yaml` (the Kubernetes Deployment for GPU clusters, from
k8s.py; with `serve.autoscale` an HPA on queue depth and KV-cache use, plus `prometheus-adapter.yaml`;
with `serve.slo_ttft_ms`/`slo_tpot_ms` p99 alerts) and `serve.json` (the local command, KV-cache
capacity, the smoke result), after a short load test through the real server (`serve:` in config)
whose latencies, and goodput against those objectives, land in MLflow and the report.

`eightfold serve --latest` resolves the newest export artifact with `latest_export_dir`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .k8s import from_lifecycle_config, write_manifests

SMOKE_PROMPT = "def fibonacci(n):\n"


def hf_dir(export_dir: Path) -> Path:
    """The export artifact keeps the Hugging Face checkpoint in `hf/`; a bare HF folder is accepted too."""
    for cand in (export_dir / "hf", export_dir):
        if (cand / "config.json").exists():
            return cand
    raise FileNotFoundError(f"no Hugging Face checkpoint (config.json) in {export_dir} or {export_dir / 'hf'}")


def latest_export_dir(workspace, stage: str = "export") -> Path:
    """Download the newest committed export artifact into the workdir and return its HF folder."""
    from infra.artifacts import latest_artifact

    art = latest_artifact(workspace.store, workspace.experiment, stage)
    if art is None:
        raise FileNotFoundError(f"no committed {stage!r} artifact in {workspace.store_uri} for experiment "
                                f"{workspace.experiment!r}: run the export stage first")
    return hf_dir(art.download(workspace.path("serve", art.fingerprint)))


def smoke_test(model_dir: Path, max_tokens: int = 16) -> dict[str, Any]:
    """Greedy tokens from the engine and from transformers on the same prompt must agree."""
    import torch
    from transformers import AutoModelForCausalLM

    from .engine import EngineConfig, LLMEngine
    from .sampling import SamplingParams

    engine = LLMEngine(model_dir, EngineConfig(kv_cache_memory_gb=0.05))
    out = engine.generate([SMOKE_PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    ids = torch.tensor([engine.encode(SMOKE_PROMPT)])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    return {"prompt": SMOKE_PROMPT, "completion": out.text, "engine_tokens": out.token_ids, "hf_tokens": ref,
            "matches_hf": out.token_ids == ref, "kv_blocks": engine.kv.pool.num_blocks,
            "kv_bytes_per_token": engine.kv_bytes_per_token}


def load_test(model_dir: Path, sc, seed: int) -> dict[str, Any]:
    """`sc.load_requests` requests at `sc.load_concurrency` through the real server in its own process
    (the figures a user of `eightfold serve` sees), stopped whatever happens."""
    import asyncio

    import httpx
    from transformers import AutoTokenizer

    from .bench import make_requests, run_load, start_server_process, summarize

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    context = int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 2048))
    # the longest request (both lengths +25%) must fit the model's context: shrink both alike if not
    fit = min(1.0, (context - 2) / (1.25 * (sc.load_input_len + sc.load_output_len)))
    input_len, output_len = max(1, int(sc.load_input_len * fit)), max(1, int(sc.load_output_len * fit))
    reqs = make_requests(tokenizer, sc.load_requests, input_len, output_len, 0.25, seed)
    proc, url = start_server_process(str(model_dir), sc.threads)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_load(url, model, reqs[:2], 2, float("inf"), seed))  # warm-up
        timings, duration = asyncio.run(run_load(url, model, reqs, sc.load_concurrency, float("inf"), seed))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
            proc.kill()
    # the objectives the PrometheusRule alerts on, measured here as goodput (bench serve --goodput)
    slos = {k: v for k, v in (("ttft", sc.slo_ttft_ms), ("tpot", sc.slo_tpot_ms)) if v}
    figures = summarize(timings, duration, slos)
    if figures["failed"]:
        raise RuntimeError(f"serve load test: {figures['failed']} of {len(reqs)} requests failed: {figures['errors']}")
    return {"requests": len(reqs), "concurrency": sc.load_concurrency, "input_len": input_len,
            "output_len": output_len, **figures}


def run(ctx) -> dict[str, Any]:
    """StageContext in: inputs["export"] (local folder), input_uris["export"]. Writes vllm.yaml, serve.json."""
    export = ctx.inputs.get("export")
    if export is None:
        raise KeyError("the serve stage needs the 'export' artifact as input")
    model_dir = hf_dir(Path(export))
    smoke = smoke_test(model_dir)
    if not smoke["matches_hf"]:
        raise RuntimeError(f"the engine and transformers disagree on {model_dir}: {smoke}")
    uri = ctx.input_uris.get("export", str(export)).rstrip("/")
    model_uri = uri + "/hf" if model_dir.name == "hf" else uri
    out = Path(ctx.out_dir)
    # vllm.yaml; with serve.autoscale also prometheus-adapter.yaml (the HPA's metrics, see k8s.py)
    manifests = write_manifests(from_lifecycle_config(ctx.cfg, model_uri), out)
    sc = ctx.cfg.serve
    load = load_test(model_dir, sc, ctx.cfg.seed) if sc.load_requests else None
    card = {"model_dir": str(model_dir), "model_uri": model_uri, "smoke": smoke, "load": load,
            "serve_locally": f"eightfold serve {model_dir}", "kubernetes": "kubectl apply -f vllm.yaml",
            "manifests": sorted(manifests)}
    (out / "serve.json").write_text(json.dumps(card, indent=2))
    figures: dict[str, Any] = {"matches_hf": smoke["matches_hf"], "kv_bytes_per_token": smoke["kv_bytes_per_token"],
                               "manifest": str(out / "vllm.yaml")}
    if load:
        figures.update({"output_tokens_per_s": round(load["output_tokens_per_s"], 2),
                        **{f"{k}_median": round(load[k]["median"], 3) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
                        **{f"{k}_p99": round(load[k]["p99"], 3) for k in ("ttft_ms", "tpot_ms", "e2e_ms")}})
        if "request_goodput" in load:
            figures.update({k: round(float(load[k]), 4) for k in ("request_goodput", "good_request_share")})
    ctx.log_metrics({"serve/kv_blocks": float(smoke["kv_blocks"]),
                     **{f"serve/{k}": float(v) for k, v in figures.items() if isinstance(v, float)}}, None)
    return figures
