"""What the serve stage deploys: the registry's champion, `models:/NAME@champion`.

The champion (set by evaluate, stages/evaluate/promote.py) is an unquantized model version; its folder,
downloaded from MLflow, is what the smoke test checks against transformers. `serve.variant` other than hf
deploys the version of that variant registered beside it (same export fingerprint). vllm.yaml names each
folder's place in the object store (the version's `artifact_uri` tag), which a pod can read, else the
version's MLflow source.

No champion (nothing evaluated yet, e.g. `eightfold stage serve` before evaluate, or export.register_model
off, or an untracked run): the stage says so and deploys the export artifact it was given, as before the
registry existed; serve.json records which it was. A lifecycle never gets there after a passing
evaluation: the shipped model is then the champion or lost to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..export.registry import CHAMPION, RegistryError, fetch_model, resolve_model_uri, sibling_version


@dataclass
class DeployedModel:
    hf_dir: Path  # the unquantized folder: the smoke test's model and the load test's tokenizer
    served_dir: Path  # serve.variant's folder: load-tested and deployed
    model_uri: str  # what vllm.yaml loads
    registry: dict[str, Any] = field(default_factory=dict)  # which version, or why none


def registry_model_name(cfg) -> str:
    return cfg.export.registered_model_name or cfg.name


def _pod_uri(mv) -> str:
    return mv.tags.get("artifact_uri") or mv.source


def champion_model(ctx, fallback, log=print) -> DeployedModel:
    """The champion's folders (downloaded into the workdir's registry cache), or `fallback()` (the export
    input's DeployedModel) with the reason recorded when there is no champion to deploy."""
    model_uri = f"models:/{registry_model_name(ctx.cfg)}@{CHAMPION}"
    why = None
    if not ctx.cfg.export.register_model:
        why = "export.register_model is off"
    elif not ctx.run_id:
        why = "the stage is not tracked (no MLflow run)"
    if why is None:
        try:
            mv = resolve_model_uri(ctx.workspace.tracking_uri, model_uri)
        except RegistryError as err:
            why = str(err)
    if why is not None:
        log(f"serve: not deploying {model_uri}: {why}; deploying the export artifact this stage was given")
        chosen = fallback()
        chosen.registry = {"model_uri": model_uri, "resolved": False, "reason": why}
        return chosen
    tracking, cache = ctx.workspace.tracking_uri, ctx.workspace.path("registry")
    variant = ctx.cfg.serve.variant
    served = sibling_version(tracking, mv, variant)
    hf = fetch_model(tracking, mv, cache)
    served_dir = hf if served is mv else fetch_model(tracking, served, cache)
    beside = f", its {variant} as version {served.version}" if served is not mv else ""
    log(f"serve: deploying {model_uri} = version {mv.version} ({mv.tags.get('variant')}, export "
        f"{mv.tags.get('export_fingerprint')}){beside}")
    registry = {"model_uri": model_uri, "resolved": True, "name": mv.name, "version": int(mv.version),
                "variant": mv.tags.get("variant"), "export_fingerprint": mv.tags.get("export_fingerprint"),
                "source_run_id": mv.run_id, "served_version": int(served.version),
                "served_variant": served.tags.get("variant"), "source": served.source}
    return DeployedModel(hf, served_dir, _pod_uri(served), registry)
