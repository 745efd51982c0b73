"""`eightfold compare` on MLflow runs written the way the lifecycle writes them: a parent per
lifecycle run (flattened config as params, `stage.<name>.*` tags, the Prefect flow-run id) with a
nested run per stage (a cache hit's tagged cached); a cached stage's figures are found through its
fingerprint."""

import re

import pytest

from flows.compare import RunNotFound, compare_command, compare_runs
from infra.tracking import Tracker, flatten_params


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run A: lr 3e-3, every stage ran. Run B: lr 1e-3, data was a cache hit (same fingerprint),
    pretrain and evaluate ran again. Returns (uri, ids)."""
    work = tmp_path_factory.mktemp("compare") / "work"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EIGHTFOLD_WORKDIR", str(work))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield _write_runs(f"sqlite:///{work}/mlflow.db")


def _write_runs(uri):
    t = Tracker(uri, "micro")
    ids = {}
    for side, lr, loss, latency, acc in (("a", 3e-3, 2.5, 12.0, 0.25), ("b", 1e-3, 2.75, 11.0, 0.5)):
        cfg = {"name": "micro", "pretrain": {"lr": lr, "steps": 20}, "model": {"dim": 64}}
        parent = t.start_run(f"lifecycle-run-{side}", tags={"kind": "lifecycle", "prefect.flow_run_id": f"flow-{side}"})
        t.log_params(parent, flatten_params(cfg))
        fps = {"data": "d" * 16, "pretrain": f"{side}" * 16, "evaluate": f"e{side}" * 8, "serve": f"s{side}" * 8}
        for stage, fp in fps.items():
            status = "cached" if (side == "b" and stage == "data") else "ran"
            t.set_tags(parent, {f"stage.{stage}.fingerprint": fp, f"stage.{stage}.status": status})
            if status == "cached":  # as tasks/stage.py records a cache hit: a nested run linking the builder
                t.cached_stage_run(stage, fp, parent, ids["a-data"], f"file:///store/{stage}/{fp}")
                continue
            run = t.start_run(f"{stage}-{fp[:8]}", parent_run_id=parent, tags={"stage": stage, "fingerprint": fp})
            if stage == "data":
                t.log_metrics(run, {"docs": 120, "bytes": 600000})
                ids["a-data"] = run
            if stage == "pretrain":
                for step, v in enumerate([4.0, 3.0, loss]):  # the comparison shows the last value
                    t.log_metrics(run, {"loss": v}, step=step)
            if stage == "evaluate":
                for variant, bump in (("hf", 0.0), ("int8", -0.05)):
                    sub = t.start_run(f"evaluate/{variant}", parent_run_id=run,
                                      tags={"stage": "evaluate", "variant": variant})
                    t.log_metrics(sub, {"arc_easy/acc": acc + bump})
                    t.end_run(sub)
            if stage == "serve":
                t.log_metrics(run, {"ttft_ms_p50": latency, "output_tokens_per_s": 100.0})
            t.end_run(run)
        t.end_run(parent)
        ids[side] = parent
    return uri, ids


def test_compare_diff_and_metrics(two_runs):
    uri, ids = two_runs
    comp = compare_runs(uri, ids["a"], ids["b"], "micro")
    assert comp.param_diff == {"pretrain.lr": ("0.003", "0.001")}
    assert comp.metrics["pretrain"]["loss"] == (2.5, 2.75)
    assert comp.metrics["serve"]["ttft_ms_p50"] == (12.0, 11.0)
    assert comp.metrics["evaluate/hf"]["arc_easy/acc"] == (0.25, 0.5)
    assert comp.metrics["evaluate/int8"]["arc_easy/acc"] == pytest.approx((0.20, 0.45))
    # B's data stage was a cache hit: its figures come from the run that made the artifact (A's).
    assert comp.metrics["data"]["docs"] == (120.0, 120.0)
    assert comp.b.stages["data"]["cached"] and comp.b.stages["data"]["run_id"] == comp.a.stages["data"]["run_id"]
    assert not comp.a.stages["data"]["cached"]


def test_a_cached_run_stands_in_when_its_builder_is_gone(tmp_path):
    """A stage flow's parent has no `stage.*` tags, and the builder may be deleted: the cached nested
    run then is the stage's row, with the figures it copied, marked cached."""
    t = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "micro")
    with t.run("lifecycle-first", tags={"kind": "lifecycle"}) as first:
        with t.run("data-dddddddd", parent_run_id=first, tags={"stage": "data", "fingerprint": "d" * 16}) as built:
            t.log_metrics(built, {"docs": 120})
    with t.run("stage-data", tags={"kind": "stage"}) as parent:
        cached = t.cached_stage_run("data", "d" * 16, parent, built, "file:///store/data")
    t.client.delete_run(built)
    comp = compare_runs(t.uri, first, parent, "micro")
    assert comp.b.stages["data"] == {"run_id": cached, "status": "FINISHED", "cached": True, "metrics": {"docs": 120.0}}


def test_compare_resolves_names_and_flow_run_ids(two_runs):
    uri, ids = two_runs
    by_flow = compare_runs(uri, "flow-a", "lifecycle-run-b", "micro")
    assert (by_flow.a.run_id, by_flow.b.run_id) == (ids["a"], ids["b"])
    with pytest.raises(RunNotFound, match="no MLflow run 'nope'.*Prefect flow-run id"):
        compare_runs(uri, "nope", ids["b"], "micro")


def test_compare_command_prints(two_runs, capsys):
    uri, ids = two_runs
    assert compare_command(ids["a"], ids["b"], "micro", []) == 0
    out = capsys.readouterr().out
    assert re.search(r"pretrain\.lr\s*│\s*0\.003\s*│\s*0\.001", out)
    assert re.search(r"loss\s*│\s*2\.5\s*│\s*2\.75\s*│\s*\+0\.25 \(\+10\.0%\)", out)
    assert f"mlflow ui --backend-store-uri {uri}" in out and "compare-runs?runs=" in out and ids["a"] in out
    assert compare_command("nope", ids["b"], "micro", []) == 2
    assert "no MLflow run 'nope'" in capsys.readouterr().err


def test_compare_without_database(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EIGHTFOLD_WORKDIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert compare_command("a", "b", "micro", []) == 2
    assert "no MLflow database at sqlite:///" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()
