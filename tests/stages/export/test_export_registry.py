"""The model registry of the export stage: every exported folder a model version whose source run is the
export stage's own run, tagged for filtering, downloadable again from `models:/NAME/VERSION`; URIs that
name no model, alias or version are refused naming what is missing. Once through a real MLflow server."""

from __future__ import annotations

import filecmp
import os

import pytest
from mlflow import MlflowClient

from fixtures.registry_models import export_folder, register_export
from stages.export.registry import (CHAMPION, RegistryError, checkpoint_step, fetch_model, parse_models_uri,
                                    resolve_model_uri, sibling_version)

PATHS = ["hf", "pretrain/hf", "quantized/int8", "quantized/gguf-q8_0"]


def _same_files(a, b) -> bool:
    names = sorted(p.name for p in a.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return match == names and not mismatch and not errors


def _check_versions(uri, tmp_path, name, server=False):
    root = export_folder(tmp_path / "export", quantized=("int8", "gguf-q8_0"))
    registered, stage_run, lifecycle = register_export(uri, f"reg-{tmp_path.name}", root, name,
                                                       quantized=("int8", "gguf-q8_0"), server=server)
    client = MlflowClient(uri, registry_uri=uri)
    fp = client.get_run(stage_run).data.tags["fingerprint"]
    assert sorted(registered["versions"]) == sorted(PATHS)
    assert registered["version"] == registered["versions"]["hf"]["version"] and registered["run_id"] == stage_run
    kinds = {"hf": ("grpo", "shipped"), "pretrain/hf": ("pretrain", "lineage"), "quantized/int8": ("int8", "quantized"),
             "quantized/gguf-q8_0": ("gguf-q8_0", "quantized")}
    artifact_root = client.get_run(stage_run).info.artifact_uri
    for path, entry in registered["versions"].items():
        mv = client.get_model_version(name, str(entry["version"]))
        assert mv.run_id == stage_run != lifecycle  # the export stage's run, not the lifecycle's
        assert mv.source == f"{artifact_root}/{path}"
        assert (mv.tags["variant"], mv.tags["kind"]) == kinds[path] and mv.tags["path"] == path
        assert mv.tags["export_fingerprint"] == fp and mv.tags["lifecycle_run_id"] == lifecycle
        assert mv.tags["artifact_uri"] == f"s3://bucket/reg-{tmp_path.name}/export/{fp}/{path}"
        assert mv.tags["architecture"] == "LlamaForCausalLM"
        # the version's folder downloads back byte for byte
        folder = fetch_model(uri, mv, tmp_path / "cache")
        assert _same_files(root / path, folder), path
    (int8,) = client.search_model_versions(f"name = '{name}' and tags.variant = 'int8'")
    assert int(int8.version) == registered["versions"]["quantized/int8"]["version"]
    return registered, client


def test_every_exported_folder_is_a_version_of_the_export_stage_run(tmp_path):
    uri = os.environ["MLFLOW_TRACKING_URI"]  # the session's sqlite database (tests/conftest.py), in a temp dir
    assert uri.startswith("sqlite:///")
    name = f"reg-{tmp_path.name}"
    registered, client = _check_versions(uri, tmp_path, name)
    shipped = resolve_model_uri(uri, f"models:/{name}/{registered['version']}")
    assert shipped.tags["kind"] == "shipped" and shipped.tags["checkpoint_step"] == "20"
    # the quantized variant beside a version is found by the export fingerprint they share
    assert int(sibling_version(uri, shipped, "int8").version) == registered["versions"]["quantized/int8"]["version"]
    assert sibling_version(uri, shipped, "hf") is shipped
    with pytest.raises(RegistryError, match=r"no registered 'fp8' variant beside it"):
        sibling_version(uri, shipped, "fp8")
    # a finished download is reused; one stamped by another registry's version of that number is not
    folder = fetch_model(uri, shipped, tmp_path / "cache")
    (folder / "mine.txt").write_text("kept")
    assert fetch_model(uri, shipped, tmp_path / "cache") == folder and (folder / "mine.txt").exists()
    (folder / ".eightfold-downloaded").write_text("models:/elsewhere/1\n")
    assert fetch_model(uri, shipped, tmp_path / "cache") == folder and not (folder / "mine.txt").exists()
    assert _same_files(tmp_path / "export" / "hf", folder)
    # a second export of the same name: new versions, numbered on
    again, _, _ = register_export(uri, f"reg-{tmp_path.name}", tmp_path / "export", name)
    assert again["version"] > max(v["version"] for v in registered["versions"].values())
    assert checkpoint_step("/x/checkpoints/step_000120") == 120 and checkpoint_step("/x/model.safetensors") is None


def test_models_uris_that_name_nothing_are_refused_naming_what_is_missing(tmp_path):
    uri = os.environ["MLFLOW_TRACKING_URI"]
    name = f"reg-{tmp_path.name}"
    assert parse_models_uri(f"models:/{name}@{CHAMPION}") == (name, CHAMPION, None)
    assert parse_models_uri(f"models:/{name}/7") == (name, None, 7)
    for bad in ("models:/", f"models:/{name}", f"runs:/{name}/7", f"models:/{name}/seven"):
        with pytest.raises(RegistryError, match="is not a registered model URI"):
            parse_models_uri(bad)
    with pytest.raises(RegistryError, match=rf"no registered model 'nope-{tmp_path.name}'"):
        resolve_model_uri(uri, f"models:/nope-{tmp_path.name}@{CHAMPION}")
    register_export(uri, name, export_folder(tmp_path / "export"), name)
    with pytest.raises(RegistryError, match=rf"'{name}' has no alias 'champion' \(evaluate sets it.*aliases: none"):
        resolve_model_uri(uri, f"models:/{name}@{CHAMPION}")
    MlflowClient(uri, registry_uri=uri).set_registered_model_alias(name, "staging", "1")
    with pytest.raises(RegistryError, match=r"has no alias 'prod'; its aliases: staging -> version 1"):
        resolve_model_uri(uri, f"models:/{name}@prod")
    with pytest.raises(RegistryError, match=rf"'{name}' has no version 99"):
        resolve_model_uri(uri, f"models:/{name}/99")


def test_versions_through_an_mlflow_server(tmp_path, mlflow_server):
    """With a server (artifacts proxied), the source lies in the export run's own artifacts, which the
    server requires of a version's source run, and the download goes through the server."""
    _check_versions(mlflow_server, tmp_path, f"reg-server-{tmp_path.name}", server=True)
