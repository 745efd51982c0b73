"""The serve stage of the lifecycle: check that the exported checkpoint serves (load it in the
engine, generate, compare the engine's greedy tokens with transformers' on the same prompt) and
write what it takes to run it: `vllm.yaml` (the Kubernetes Deployment for GPU clusters, from
k8s.py; with `serve.autoscale` an HPA on queue depth and KV-cache use, plus `prometheus-adapter.yaml`;
with `serve.slo_ttft_ms`/`slo_tpot_ms` p99 alerts) and `serve.json` (the local command, KV-cache
capacity, the smoke result), after a short load test through the real server (`serve:` in config)
whose latencies, and goodput against those objectives, land in MLflow and the report.

`serve.variant` picks what is deployed and load-tested: `hf/` or the export's `quantized/<variant>/`
(the engine loads the compressed-tensors folders itself), with the engine's FP8 KV cache when
`serve.kv_cache_dtype` is fp8, as vllm.yaml's `--kv-cache-dtype`. The smoke test's comparison with
transformers stays on the unquantized `hf/` (a quantized variant is not meant to match it token for
token; the export stage already bounds its loss). With `serve.canary`, vllm.yaml deploys this export
as the canary beside the stable model ("previous": the newest earlier export artifact, resolved with
`previous_export_uri`). `serve.json` records which variant was load-tested and what was deployed.

What is deployed is the registry's champion, `models:/NAME@champion` (champion.py: the version evaluate
promoted, downloaded from MLflow, and its `serve.variant` registered beside it); with no champion the stage
says so and deploys the export artifact it was given. `serve.json`'s `deployed.registry` records which
version it served, or why none.

`eightfold serve --latest` resolves the newest export artifact with `latest_export_dir`;
`eightfold serve models:/NAME@ALIAS` a registry version (stages/export/registry.py)."""

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


def variant_dir(export_dir: Path, variant: str) -> Path:
    """The folder `serve.variant` names: the HF checkpoint for "hf", else `quantized/<variant>/`."""
    if variant == "hf":
        return hf_dir(export_dir)
    folder = export_dir / variant_path(variant)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"serve.variant={variant}: no {folder}/config.json in the export (is {variant!r} "
                                f"in export.variants of the run that made it?)")
    return folder


def variant_path(variant: str) -> str:
    return "hf" if variant == "hf" else f"quantized/{variant}"


def previous_export_uri(store, experiment: str, current_uri: str, variant: str, stage: str = "export") -> str:
    """The stable model for a canary: `variant`'s folder in the newest committed export artifact older
    than `current_uri` (the one being rolled out); named errors when there is none or it lacks the variant."""
    from infra.artifacts import list_artifacts

    arts = [a for a in list_artifacts(store, experiment, stage) if a.stage == stage]  # newest first
    current = next((a for a in arts if a.uri.rstrip("/") == current_uri.rstrip("/")), None)
    older = [a for a in arts if a is not current and (current is None or a.created < current.created)]
    if not older:
        raise FileNotFoundError(f"serve.canary.stable_model_uri is 'previous' but experiment {experiment!r} has no "
                                f"{stage} artifact older than {current_uri}: name the stable model's URI instead")
    prev, folder = older[0], variant_path(variant)
    if f"{folder}/config.json" not in prev.files:
        raise FileNotFoundError(f"serve.canary.stable_model_uri is 'previous' ({prev.uri}), which has no {folder}/ "
                                f"(serve.variant={variant}): name the stable model's URI instead")
    return f"{prev.uri.rstrip('/')}/{folder}"


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

    from ..export.validate import load_causal_lm
    from .engine import EngineConfig, LLMEngine
    from .sampling import SamplingParams

    engine = LLMEngine(model_dir, EngineConfig(kv_cache_memory_gb=0.05))
    out = engine.generate([SMOKE_PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    hf = load_causal_lm(model_dir)
    ids = torch.tensor([engine.encode(SMOKE_PROMPT)])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    tie = divergence_is_a_tie(hf, ids[0].tolist(), out.token_ids, ref)
    return {"prompt": SMOKE_PROMPT, "completion": out.text, "engine_tokens": out.token_ids, "hf_tokens": ref,
            "matches_hf": out.token_ids == ref or tie is not None, "tie": tie, "kv_blocks": engine.kv.pool.num_blocks,
            "kv_pool_bytes": engine.kv_budget.pool_bytes, "decode_slot_bytes_reserved": engine.kv_budget.slot_bytes,
            "kv_bytes_per_token": engine.kv_bytes_per_token}


def divergence_is_a_tie(hf, prompt: list[int], ours: list[int], theirs: list[int], rel_tol: float = 1e-4) -> dict | None:
    """Two fp32 implementations of the same weights differ by ~1e-6 of the largest logit, so free-running
    greedy outputs can part only where transformers' own logits nearly tie between the two tokens. At the
    first position where they part: the gap in transformers' logits (relative to its largest |logit|)
    when it is within rel_tol, else None (a real disagreement, or none at all)."""
    import torch

    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if i is None:
        return None
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:i]])).logits[0, -1].float()
    gap = float((logits[theirs[i]] - logits[ours[i]]) / logits.abs().max().clamp_min(1e-12))
    return {"position": i, "relative_gap": gap} if gap <= rel_tol else None


def load_test(model_dir: Path, sc, seed: int, tokenizer_dir: Path | None = None) -> dict[str, Any]:
    """`sc.load_requests` requests at `sc.load_concurrency` through the real server in its own process
    (the figures a user of `eightfold serve` sees), on `sc.kv_cache_dtype`'s KV cache, stopped whatever
    happens. Prompts come from `tokenizer_dir` (default: the model's folder)."""
    import asyncio

    import httpx
    from transformers import AutoTokenizer

    from .bench import make_requests, run_load, start_server_process, summarize

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or model_dir))
    context = int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 2048))
    # the longest request (both lengths +25%) must fit the model's context: shrink both alike if not
    fit = min(1.0, (context - 2) / (1.25 * (sc.load_input_len + sc.load_output_len)))
    input_len, output_len = max(1, int(sc.load_input_len * fit)), max(1, int(sc.load_output_len * fit))
    reqs = make_requests(tokenizer, sc.load_requests, input_len, output_len, 0.25, seed)
    kv = {"kv_cache_dtype": sc.kv_cache_dtype} if sc.kv_cache_dtype != "auto" else {}
    if sc.enforce_eager:
        kv["enforce_eager"] = True
    # start-up compiles the decode step for every batch size: minutes on a loaded 2-core machine, so no
    # short deadline (a server that dies is seen at once); the lifecycle must not fail on a slow machine
    proc, url = start_server_process(str(model_dir), sc.threads, timeout=1800.0, **kv)
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
    return {"model_dir": str(model_dir), "kv_cache_dtype": sc.kv_cache_dtype,
            "requests": len(reqs), "concurrency": sc.load_concurrency, "input_len": input_len,
            "output_len": output_len, **figures}


def local_name(chosen) -> str:
    """How `eightfold serve` names what was deployed: the registry version, or the folder."""
    reg = chosen.registry
    if not reg.get("resolved"):
        return str(chosen.served_dir)
    return reg["model_uri"] if reg["served_version"] == reg["version"] else f"models:/{reg['name']}/{reg['served_version']}"


def export_model(export: Path, uri: str, variant: str) -> "DeployedModel":
    """The export artifact this stage was given, as deployed without the registry: its hf/ and
    `variant`'s folder, and their URIs in the store."""
    from .champion import DeployedModel

    model_dir = hf_dir(export)
    if variant != "hf":
        model_uri = f"{uri}/{variant_path(variant)}"
    else:
        model_uri = uri + "/hf" if model_dir.name == "hf" else uri
    return DeployedModel(model_dir, variant_dir(export, variant), model_uri)


def run(ctx) -> dict[str, Any]:
    """StageContext in: inputs["export"] (local folder), input_uris["export"]. Deploys the registry's champion
    (champion.py), else that export. Writes vllm.yaml, serve.json."""
    from .champion import champion_model

    export = ctx.inputs.get("export")
    if export is None:
        raise KeyError("the serve stage needs the 'export' artifact as input")
    sc = ctx.cfg.serve
    # what vllm.yaml deploys and the load test serves, and a canary's stable model: resolved first, so
    # a missing variant, champion's download or previous export fails before the checks run
    uri = ctx.input_uris.get("export", str(export)).rstrip("/")
    chosen = champion_model(ctx, lambda: export_model(Path(export), uri, sc.variant))
    model_dir, served_dir, model_uri = chosen.hf_dir, chosen.served_dir, chosen.model_uri
    if chosen.registry.get("resolved"):
        ctx.log_params({"serve.registry_model": f"models:/{chosen.registry['name']}/{chosen.registry['served_version']}"})
    stable_uri = None
    if sc.canary and sc.canary.stable_model_uri == "previous":
        ws = ctx.workspace
        stable_uri = previous_export_uri(ws.store, ws.experiment, uri, sc.variant)
    smoke = smoke_test(model_dir)  # the unquantized checkpoint against transformers
    if not smoke["matches_hf"]:
        raise RuntimeError(f"the engine and transformers disagree on {model_dir}: {smoke}")
    out = Path(ctx.out_dir)
    # vllm.yaml; with serve.autoscale also prometheus-adapter.yaml (the HPA's metrics, see k8s.py)
    deployment = from_lifecycle_config(ctx.cfg, model_uri, stable_model_uri=stable_uri)
    manifests = write_manifests(deployment, out)
    load = load_test(served_dir, sc, ctx.cfg.seed, tokenizer_dir=model_dir) if sc.load_requests else None
    deployed: dict[str, Any] = {"variant": sc.variant, "model_uri": model_uri, "kv_cache_dtype": sc.kv_cache_dtype,
                                "registry": chosen.registry}
    if deployment.canary:
        stable_w, canary_w = deployment.canary.weights
        deployed.update(rollout="canary", stable_model_uri=deployment.model_uri,
                        weights={"stable": stable_w, "canary": canary_w}, gateway=deployment.canary.gateway)
    card = {"model_dir": str(model_dir), "model_uri": model_uri, "variant": sc.variant,
            "smoke_on": "hf (transformers reference)", "smoke": smoke,
            "load_tested": {"variant": sc.variant, "model_dir": str(served_dir), "kv_cache_dtype": sc.kv_cache_dtype}
            if load else None,
            "load": load, "deployed": deployed,
            "serve_locally": f"eightfold serve {local_name(chosen)}"
                             + (" --kv-cache-dtype fp8" if sc.kv_cache_dtype == "fp8" else "")
                             + (" --enforce-eager" if sc.enforce_eager else ""),
            "kubernetes": "kubectl apply -f vllm.yaml", "manifests": sorted(manifests)}
    (out / "serve.json").write_text(json.dumps(card, indent=2))
    figures: dict[str, Any] = {"matches_hf": smoke["matches_hf"], "kv_bytes_per_token": smoke["kv_bytes_per_token"],
                               "manifest": str(out / "vllm.yaml")}
    if load:
        figures.update({"output_tokens_per_s": round(load["output_tokens_per_s"], 2),
                        **{f"{k}_median": round(load[k]["median"], 3) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
                        **{f"{k}_p99": round(load[k]["p99"], 3) for k in ("ttft_ms", "tpot_ms", "e2e_ms")}})
        if "request_goodput" in load:
            figures.update({k: round(float(load[k]), 4) for k in ("request_goodput", "good_request_share")})
    if chosen.registry.get("resolved"):
        figures.update({"served_version": chosen.registry["served_version"], "champion_version": chosen.registry["version"]})
    ctx.log_metrics({"serve/kv_blocks": float(smoke["kv_blocks"]),
                     **{f"serve/{k}": float(v) for k, v in figures.items() if isinstance(v, float)}}, None)
    return figures
