"""The MLflow model registry: every exported variant a model version, found again by alias.

The export stage registers each model folder it writes, the model it ships (`hf/`), the earlier
models of the chain (`<step>/hf`: pretrain, sft, dpo) and every quantized variant
(`quantized/<variant>/`, GGUF included), as a version of one registered model
(`export.registered_model_name`, default the config name). Each folder is logged as plain artifacts
of the export stage's own MLflow run, under the same relative path, and that run is the version's
source run, so the registry links every version to the run that made it (and to its lifecycle
through the `lifecycle_run_id` tag). Plain artifacts rather than the transformers flavour: no model
object in memory, works offline, and the folder is exactly what vLLM and our engine load. LoRA
adapters are not versions: each needs its base folder beside it (`../../<step>/hf`), which the
lineage versions are.

Tags a user filters versions by (`search_model_versions("tags.variant = 'int8'")`): `variant` (the
evaluation table's row name: the shipped step such as grpo, a lineage step, or the quantization),
`kind` (shipped, lineage, quantized), `path` (the folder in the export artifact), `step` (the model of
the chain the weights come from), `export_fingerprint`, `artifact_uri` (the folder in the object
store), `checkpoint`, `checkpoint_step`, `architecture`, `lifecycle_run_id`.

The evaluate stage moves the `champion` and `challenger` aliases (stages/evaluate/promote.py);
`models:/NAME@ALIAS` (or `models:/NAME/VERSION`) is resolved by `resolve_model_uri` and downloaded
into a local folder by `fetch_model`, which is what `eightfold serve models:/NAME@champion` and the
serve stage serve.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAMPION, CHALLENGER = "champion", "challenger"
_COMPLETE = ".eightfold-downloaded"  # written last into a downloaded version's folder


class RegistryError(LookupError):
    """A models:/ URI that names no model, alias or version; the message names what is missing."""


@dataclass
class ExportedModel:
    """One folder of the export artifact to register: `path` relative to the artifact's root."""

    path: str
    variant: str
    kind: str  # shipped, lineage or quantized
    step: str
    tags: dict[str, str] = field(default_factory=dict)


def checkpoint_step(checkpoint: str | Path) -> int | None:
    """The training step in a checkpoint folder's name (`step_000100` -> 100), None when it has none."""
    m = re.search(r"step_(\d+)", Path(str(checkpoint)).name)
    return int(m.group(1)) if m else None


def registry_client(tracking_uri: str):
    from infra.tracking import mlflow_client

    return mlflow_client(tracking_uri, registry_uri=tracking_uri)


def is_not_found(exc: Exception) -> bool:
    return "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "not found" in str(exc).lower()


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="exported by eightfold's export stage")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code) and "already exists" not in str(exc):
            raise


def register_variants(tracking_uri: str, run_id: str, out_dir: str | Path, name: str, models: list[ExportedModel],
                      tags: dict[str, Any] | None = None, artifact_root: str | None = None) -> dict[str, Any]:
    """Log each model's folder under the same path in run `run_id`'s artifacts and register it as a version
    of `name` whose source run is `run_id` (the export stage's own run). `tags` go on every version;
    `artifact_root` (the export artifact's store URI) gives each version its `artifact_uri` tag.
    Returns {"name", "run_id", "version", "source" (of the shipped model), "versions": {path: {...}}}."""
    client = registry_client(tracking_uri)
    run = client.get_run(run_id)
    common = {"stage_run_id": run_id, "export_fingerprint": run.data.tags.get("fingerprint", ""),
              "lifecycle_run_id": run.data.tags.get("mlflow.parentRunId", ""), **(tags or {})}
    _ensure_registered_model(client, name)
    versions: dict[str, dict[str, Any]] = {}
    for m in models:
        client.log_artifacts(run_id, str(Path(out_dir) / m.path), artifact_path=m.path)
        source = f"{run.info.artifact_uri.rstrip('/')}/{m.path}"
        version_tags = {**common, "variant": m.variant, "kind": m.kind, "path": m.path, "step": m.step, **m.tags}
        if artifact_root:
            version_tags["artifact_uri"] = f"{artifact_root.rstrip('/')}/{m.path}"
        mv = client.create_model_version(name, source=source, run_id=run_id,
                                         tags={k: str(v) for k, v in version_tags.items() if v not in (None, "")},
                                         description=f"{m.variant} ({m.kind}) from the export stage's run {run_id}")
        versions[m.path] = {"version": int(mv.version), "variant": m.variant, "kind": m.kind, "source": source}
    shipped = next((v for v in versions.values() if v["kind"] == "shipped"), None)
    return {"name": name, "run_id": run_id, "version": shipped and shipped["version"],
            "source": shipped and shipped["source"], "versions": versions}


def parse_models_uri(uri: str) -> tuple[str, str | None, int | None]:
    """`models:/NAME@ALIAS` -> (NAME, ALIAS, None); `models:/NAME/VERSION` -> (NAME, None, VERSION)."""
    m = re.fullmatch(r"models:/([^/@]+)(?:@([^/@]+)|/(\d+))/?", uri.strip())
    if not m:
        raise RegistryError(f"{uri!r} is not a registered model URI: use models:/NAME@ALIAS (e.g. "
                            f"models:/tiny@{CHAMPION}) or models:/NAME/VERSION")
    return m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None


def resolve_model_uri(tracking_uri: str, uri: str):
    """The ModelVersion `uri` names; RegistryError naming the unknown model, alias or version."""
    from mlflow.exceptions import MlflowException

    name, alias, version = parse_models_uri(uri)
    client = registry_client(tracking_uri)
    try:
        model = client.get_registered_model(name)
    except MlflowException as exc:
        if not is_not_found(exc):
            raise
        known = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise RegistryError(f"no registered model {name!r} at {tracking_uri} (registered: "
                            f"{', '.join(known) or 'none'}); the export stage registers one per config name") from None
    if alias is not None:
        aliases = dict(model.aliases or {})
        if alias not in aliases:
            have = ", ".join(f"{a} -> version {v}" for a, v in sorted(aliases.items())) or "none"
            hint = " (evaluate sets it when the gates pass and the model beats the champion)" if alias == CHAMPION else ""
            raise RegistryError(f"registered model {name!r} has no alias {alias!r}{hint}; its aliases: {have}")
        return client.get_model_version_by_alias(name, alias)
    try:
        return client.get_model_version(name, str(version))
    except MlflowException as exc:
        if not is_not_found(exc):
            raise
        raise RegistryError(f"registered model {name!r} has no version {version}") from None


def sibling_version(tracking_uri: str, mv, variant: str):
    """The version of `variant` exported beside `mv` (same export fingerprint): e.g. the int8 of the
    champion. RegistryError when that export registered no such variant."""
    fp = mv.tags.get("export_fingerprint")
    if mv.tags.get("variant") == variant or (variant == "hf" and mv.tags.get("path") == "hf"):
        return mv
    found = registry_client(tracking_uri).search_model_versions(
        f"name = '{mv.name}' and tags.export_fingerprint = '{fp}' and tags.variant = '{variant}'")
    if not found:
        raise RegistryError(f"version {mv.version} of {mv.name!r} (export {fp}) has no registered {variant!r} variant "
                            f"beside it: was {variant!r} in export.variants of the run that made it?")
    return max(found, key=lambda v: int(v.version))


def fetch_model(tracking_uri: str, mv, cache_dir: str | Path) -> Path:
    """Download version `mv`'s folder into `cache_dir/<name>/<version>` (once: a finished download of the
    same source is reused; another registry's version of that number is not) and return that folder."""
    import mlflow.artifacts

    client = registry_client(tracking_uri)
    dst = Path(cache_dir) / mv.name / str(mv.version)
    uri = client.get_model_version_download_uri(mv.name, mv.version)
    stamp = f"models:/{mv.name}/{mv.version}\n{uri}\n"
    if (dst / _COMPLETE).is_file() and (dst / _COMPLETE).read_text() == stamp:
        return dst
    shutil.rmtree(dst, ignore_errors=True)  # an interrupted download is started again
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    got = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp), tracking_uri=tracking_uri))
    # the folder lands inside dst_path under its own last name (hf, quantized/int8 -> int8)
    got.rename(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    (dst / _COMPLETE).write_text(stamp)
    return dst
