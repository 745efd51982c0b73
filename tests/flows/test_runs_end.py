"""Every MLflow run a stage, flow or sweep opens ends (infra.tracking.Tracker.run): FINISHED when the
body returns, FAILED on an error wherever it is raised (the params, the inputs' download, the stage,
the commit), KILLED on Ctrl-C. None stays RUNNING."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

import tasks.stage as stage_task
from infra.config import load_config
from infra.tracking import Tracker
from infra.workspace import Workspace
from tasks.stage import ArtifactRef, MissingUpstream


def _micro(tmp_path):
    cfg = load_config("micro")
    cfg.infra.workdir = str(tmp_path / "work")
    cfg.infra.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return cfg


def _statuses(cfg) -> list[str]:
    ws = Workspace.from_config(cfg)
    client = mlflow.MlflowClient(ws.tracking_uri)
    exp = client.get_experiment_by_name(ws.experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else []
    return [r.info.status for r in runs]


def test_tracker_run_ends_finished_failed_or_killed(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "runs-end")
    with tracker.run("ok") as ok:
        pass
    with pytest.raises(ValueError), tracker.run("error") as error:
        raise ValueError("boom")
    with pytest.raises(KeyboardInterrupt), tracker.run("ctrl-c") as killed:
        raise KeyboardInterrupt
    client = mlflow.MlflowClient(tracker.uri)
    assert [client.get_run(r).info.status for r in (ok, error, killed)] == ["FINISHED", "FAILED", "KILLED"]


@pytest.mark.parametrize("where", ["log_params", "inputs", "commit"])
def test_a_stage_that_fails_outside_its_own_code_fails_its_run(tmp_path, monkeypatch, where):
    cfg = _micro(tmp_path)
    inputs: dict[str, ArtifactRef] = {}
    stage = "data"
    if where == "log_params":
        monkeypatch.setattr(Tracker, "log_params", lambda *a, **k: (_ for _ in ()).throw(OSError("tracking down")))
        error = OSError
    elif where == "inputs":  # an upstream that is not committed: raised while its download is prepared
        stage, inputs, error = "tokenizer", {"data": ArtifactRef("data", "0" * 16, "file:///nowhere")}, MissingUpstream
    else:
        monkeypatch.setattr(stage_task, "commit_artifact", lambda *a, **k: (_ for _ in ()).throw(OSError("store full")))
        error = OSError
    with pytest.raises(error):
        stage_task.execute_stage(cfg, stage, inputs, log=lambda _: None)
    assert _statuses(cfg) == ["FAILED"]


def test_a_stage_that_commits_finishes_its_run(tmp_path):
    cfg = _micro(tmp_path)
    ref = stage_task.execute_stage(cfg, "data", {}, log=lambda _: None)
    assert not ref.cached and _statuses(cfg) == ["FINISHED"]


def test_a_stages_inputs_are_dataset_inputs_of_its_run(tmp_path):
    cfg = _micro(tmp_path)
    data = stage_task.execute_stage(cfg, "data", {}, log=lambda _: None)
    tok = stage_task.execute_stage(cfg, "tokenizer", {"data": data}, log=lambda _: None)
    client = mlflow.MlflowClient(Workspace.from_config(cfg).tracking_uri)
    run_id = stage_task.find_artifact(Workspace.from_config(cfg).store, "micro", "tokenizer",
                                      tok.fingerprint).manifest["mlflow_run_id"]
    (inp,) = client.get_run(run_id).inputs.dataset_inputs
    assert (inp.dataset.name, inp.dataset.digest, inp.dataset.source_type) == ("data", data.fingerprint, "local")
    assert data.uri in inp.dataset.source and {t.key: t.value for t in inp.tags} == {"mlflow.data.context": "input"}


def test_tables_and_figures_land_in_the_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tables", artifact_location=str(tmp_path / "mlruns"))
    with tracker.run("evaluate") as run_id:
        tracker.log_table(run_id, {"variant": ["hf", "int8"], "acc": [0.5, 0.25]}, "evaluation_table.json")
        fig, ax = plt.subplots()
        ax.plot([1, 2], [3, 4])
        tracker.log_figure(run_id, fig, "loss.png")
        plt.close(fig)
    names = {a.path for a in tracker.client.list_artifacts(run_id)}
    assert {"evaluation_table.json", "loss.png"} <= names
    import json

    table = json.loads(Path(tracker.client.download_artifacts(run_id, "evaluation_table.json", str(tmp_path))).read_text())
    assert table == {"columns": ["variant", "acc"], "data": [["hf", 0.5], ["int8", 0.25]]}  # MLflow's table format
    assert '"type": "table"' in tracker.client.get_run(run_id).data.tags["mlflow.loggedArtifacts"]
