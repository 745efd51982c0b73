"""Serving by alias: `eightfold serve models:/NAME@champion` downloads the champion's folder and serves
it (once for real, through the command line in its own process), unknown models and aliases are refused
naming them, and the serve stage deploys the champion (and its serve.variant beside it) or, with no
champion, says so and deploys the export it was given."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from fixtures.registry_models import export_folder, register_export
from infra.config import load_config
from infra.workspace import Workspace
from stages.base import StageContext

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def champion(tmp_path, tiny_hf_model_dir, monkeypatch):
    """An export of the tiny checkpoint (hf/, pretrain/hf, quantized/int8: each a servable copy that knows
    which folder it is) registered in the session's sqlite registry, its hf/ version the champion."""
    uri = os.environ["MLFLOW_TRACKING_URI"]
    name = f"serve-{tmp_path.name}"
    monkeypatch.setenv("EIGHTFOLD_WORKDIR", str(tmp_path / "work"))
    root = export_folder(tmp_path / "export", model_dir=tiny_hf_model_dir)
    registered, stage_run, _ = register_export(uri, name, root, name)
    return uri, name, root, registered, stage_run


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return match == names and not mismatch and not errors


def test_eightfold_serve_resolves_an_alias_to_the_versions_folder(champion, monkeypatch):
    import stages.serve.cli as serve_cli
    from flows.cli import app

    uri, name, root, registered, _ = champion
    client = MlflowClient(uri, registry_uri=uri)
    runner = CliRunner()
    res = runner.invoke(app, ["serve", f"models:/{name}@champion"])
    assert res.exit_code == 3 and f"registered model '{name}' has no alias 'champion'" in res.output, res.output
    res = runner.invoke(app, ["serve", f"models:/missing-{name}@champion"])
    assert res.exit_code == 3 and f"no registered model 'missing-{name}'" in res.output, res.output

    client.set_registered_model_alias(name, "champion", str(registered["version"]))
    client.set_registered_model_alias(name, "challenger", str(registered["versions"]["quantized/int8"]["version"]))
    served = []
    monkeypatch.setattr(serve_cli, "main", lambda argv, **_: served.append(argv) or 0)
    for alias, rel in (("champion", "hf"), ("challenger", "quantized/int8")):
        res = runner.invoke(app, ["serve", f"models:/{name}@{alias}", "--port", "8123"])
        assert res.exit_code == 0, res.output
        argv = served[-1]
        folder = Path(argv[1])
        assert argv[0] == "serve" and argv[2:] == ["--port", "8123"]
        assert folder.is_relative_to(Path(os.environ["EIGHTFOLD_WORKDIR"]) / "registry" / name)
        assert (folder / "which.txt").read_text() == rel and _same_files(root / rel, folder)


@pytest.mark.slow
def test_eightfold_serve_models_uri_starts_a_server(champion):
    """The command a user types, in its own process: the champion downloaded and answering completions."""
    import httpx

    from stages.serve.bench import free_port, wait_healthy

    uri, name, root, registered, _ = champion
    MlflowClient(uri, registry_uri=uri).set_registered_model_alias(name, "champion", str(registered["version"]))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", f"models:/{name}@champion", "--port", str(port),
                             "--enforce-eager", "--threads", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 300, "eightfold serve", lambda: proc.stdout.read().decode())
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        out = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "def f(x):", "max_tokens": 4,
                                                        "temperature": 0}, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(30)
    log = proc.stdout.read().decode()
    assert f"models:/{name}@champion is version {registered['version']} (grpo" in log, log[-2000:]


def _ctx(tmp_path, root, name, *overrides, run_id="serve-run"):
    cfg = load_config("configs/tiny.yaml", [f"export.registered_model_name={name}", "serve.load_requests=0",
                                            *overrides])
    ws = Workspace(tmp_path / "work", f"file://{tmp_path}/store", os.environ["MLFLOW_TRACKING_URI"], "serve-test")
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return StageContext(cfg=cfg, workspace=ws, out_dir=out, inputs={"export": root},
                        input_uris={"export": "s3://bucket/serve-test/export/given"}, run_id=run_id)


def test_serve_stage_deploys_the_champion_and_its_variant(champion, tmp_path):
    from stages.serve.champion import champion_model
    from stages.serve.stage import export_model

    uri, name, root, registered, stage_run = champion
    client = MlflowClient(uri, registry_uri=uri)
    given = tmp_path / "given"  # the export artifact the stage was handed (a different folder)
    export_folder(given, model_dir=root / "hf")

    def fallback(ctx):
        return lambda: export_model(given, ctx.input_uris["export"], ctx.cfg.serve.variant)

    # no champion yet: said, recorded, and the given export is deployed
    ctx = _ctx(tmp_path, given, name)
    said = []
    chosen = champion_model(ctx, fallback(ctx), log=said.append)
    assert chosen.hf_dir == given / "hf" and chosen.model_uri == "s3://bucket/serve-test/export/given/hf"
    assert chosen.registry["resolved"] is False and "has no alias 'champion'" in chosen.registry["reason"]
    assert f"not deploying models:/{name}@champion" in said[0]
    for off, why in ((["export.register_model=false"], "export.register_model is off"), ([], "not tracked")):
        c = _ctx(tmp_path, given, name, *off, run_id=None if not off else "serve-run")
        assert why in champion_model(c, fallback(c), log=said.append).registry["reason"]

    client.set_registered_model_alias(name, "champion", str(registered["version"]))
    ctx = _ctx(tmp_path, given, name, "serve.variant=int8")
    chosen = champion_model(ctx, fallback(ctx), log=said.append)
    int8 = registered["versions"]["quantized/int8"]["version"]
    assert (chosen.hf_dir / "which.txt").read_text() == "hf"
    assert (chosen.served_dir / "which.txt").read_text() == "quantized/int8"
    assert chosen.model_uri == client.get_model_version(name, str(int8)).tags["artifact_uri"]
    assert chosen.registry == {**chosen.registry, "resolved": True, "version": registered["version"], "variant": "grpo",
                               "served_version": int8, "served_variant": "int8", "source_run_id": stage_run}


@pytest.mark.slow
def test_serve_stage_records_the_version_it_served(champion, tmp_path):
    """The stage end to end (no load test): the champion's folder passes the smoke test, vllm.yaml loads its
    folder in the store, serve.json names the version."""
    import yaml

    from stages.serve.stage import run

    uri, name, root, registered, _ = champion
    MlflowClient(uri, registry_uri=uri).set_registered_model_alias(name, "champion", str(registered["version"]))
    ctx = _ctx(tmp_path, root, name)
    figures = run(ctx)
    card = json.loads((ctx.out_dir / "serve.json").read_text())
    assert figures["served_version"] == figures["champion_version"] == registered["version"]
    assert card["deployed"]["registry"]["version"] == registered["version"] and card["smoke"]["matches_hf"]
    assert card["serve_locally"].startswith(f"eightfold serve models:/{name}@champion")
    # the version's folder in the store, which the pod's init container copies in
    fp = MlflowClient(uri, registry_uri=uri).get_model_version(name, str(registered["version"])).tags["export_fingerprint"]
    assert card["model_uri"] == card["deployed"]["model_uri"] == f"s3://bucket/{name}/export/{fp}/hf"
    docs = {d["kind"]: d for d in yaml.safe_load_all((ctx.out_dir / "vllm.yaml").read_text())}
    init = docs["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]
    assert card["model_uri"] in json.dumps(init)
