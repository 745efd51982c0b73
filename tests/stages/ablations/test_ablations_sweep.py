"""A real sweep through Prefect: 3 proxy sizes x 2 learning rates as trainer jobs, 2 at a time, each a
nested MLflow run under the ablations stage's run, choice.json committed; widening the sweep by one
learning rate trains only the 3 new proxies."""

import json

import mlflow
import pytest
from prefect import flow

from fixtures.progress import final
from fixtures.trainer_data import make_tokens, tiny_config
from infra.artifacts import commit_artifact, find_artifact
from infra.workspace import Workspace
from tasks.stage import ArtifactRef, execute_stage

pytestmark = pytest.mark.slow

LRS = [1e-3, 1e-2]


def sweep_config(tmp, lrs):
    cfg = tiny_config(steps=40, warmup_steps=2)
    cfg.infra.workdir = str(tmp / "work")
    cfg.infra.tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cfg.ablations = cfg.ablations.model_validate({
        "sizes": [{"dim": 16, "n_layers": 1}, {"dim": 32, "n_layers": 1}, {"dim": 48, "n_layers": 2}],
        "tokens_per_param": None, "token_budgets": [2560], "sweep": {"lr": lrs}, "concurrency": 2,
        "eval_batches": 2,
    })
    return cfg


@flow(name="ablations-test")
def ablations_flow(cfg, tokens_ref):
    import tasks.ablations  # noqa: F401  (installs the Prefect proxy runner, as the lifecycle does)

    return execute_stage(cfg, "ablations", {"tokens": tokens_ref})


def _max_overlap(results):
    events = sorted([(r["started"], 1) for r in results] + [(r["ended"], -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    now = most = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def test_sweep_runs_proxies_through_prefect_and_widens_incrementally(tmp_path, prefect_harness, capsys):
    cfg = sweep_config(tmp_path, LRS)
    ws = Workspace.from_config(cfg)
    tokens = make_tokens(tmp_path / "tokens-src")
    art = commit_artifact(ws.store, ws.experiment, "tokens", "0123456789abcdef", tokens, config={})
    tokens_ref = ArtifactRef("tokens", art.fingerprint, art.uri)

    ref = ablations_flow(cfg, tokens_ref)
    assert ref.summary["proxies"] == 6 and ref.summary["proxies_trained"] == 6
    bar = final(capsys.readouterr().err, "ablations")  # the sweep's progress bar, a tick per proxy
    assert (bar.n, bar.total, bar.unit) == ("6", "6", "proxy")
    stage_art = find_artifact(ws.store, ws.experiment, "ablations", ref.fingerprint)
    out = stage_art.download(tmp_path / "first")
    choice = json.loads((out / "choice.json").read_text())
    assert min(LRS) <= choice["lr"] <= max(LRS) and choice["global_batch_size"] == 8
    assert len(choice["per_size"]) == 3 and choice["prediction"]["val_loss"] > 0
    assert (out / "loss_vs_lr.png").stat().st_size > 1000 and (out / "scaling_law.png").is_file()
    results = json.loads((out / "results.json").read_text())
    assert _max_overlap(results) == 2  # the concurrency limit held, and proxies did run side by side

    client = mlflow.MlflowClient(cfg.infra.tracking_uri)
    stage_run = stage_art.manifest["mlflow_run_id"]
    exp = client.get_experiment_by_name(ws.experiment).experiment_id
    proxies = client.search_runs([exp], "tags.stage = 'ablations/proxy'")
    assert len(proxies) == 6
    for run in proxies:
        assert run.data.tags["mlflow.parentRunId"] == stage_run and run.info.status == "FINISHED"
        assert "final_val_loss" in run.data.metrics and run.data.params["proxy.lr"]
        assert len(client.get_metric_history(run.info.run_id, "loss")) == 10  # 2560 tokens / (8 x 32) steps
    assert {r.data.params["proxy.lr"] for r in proxies} == {str(lr) for lr in LRS}

    wider = sweep_config(tmp_path, LRS + [3e-2])
    ref2 = ablations_flow(wider, tokens_ref)
    assert ref2.fingerprint != ref.fingerprint
    assert (ref2.summary["proxies"], ref2.summary["proxies_trained"], ref2.summary["proxies_cached"]) == (9, 3, 6)
    bar = final(capsys.readouterr().err, "ablations")  # cached proxies count too
    assert (bar.n, bar.total, bar.unit) == ("9", "9", "proxy")
    proxies = client.search_runs([exp], "tags.stage = 'ablations/proxy'")
    assert len(proxies) == 9
    new = [r for r in proxies if r.data.params["proxy.lr"] == "0.03"]
    assert len(new) == 3
