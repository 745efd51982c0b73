"""The lifecycle flow on the micro config: stages run in order, a second run is all cache hits, a
forced stage re-runs only itself and what reads it, and MLflow holds one parent run with a nested
run per stage, in every lifecycle run: a cache hit's tagged cached, linking the run that built the
artifact and carrying its figures."""

import mlflow
import pytest

from infra.config import load_config
from infra.workspace import Workspace

pytestmark = pytest.mark.slow

STAGES = ["data", "tokenizer", "tokens"]


@pytest.fixture
def micro_workdir(tmp_path, monkeypatch, prefect_harness):
    monkeypatch.setenv("EIGHTFOLD_WORKDIR", str(tmp_path / "work"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "work"


def _status(result):
    return {stage: ("cached" if ref["cached"] else "ran") for stage, ref in result.items()}


def test_cache_hits_and_forced_downstream(micro_workdir):
    from flows.lifecycle import lifecycle

    first = lifecycle(config="micro", stages=STAGES)
    assert _status(first) == {s: "ran" for s in STAGES}

    second = lifecycle(config="micro", stages=STAGES)
    assert _status(second) == {s: "cached" for s in STAGES}
    assert {s: r["fingerprint"] for s, r in second.items()} == {s: r["fingerprint"] for s, r in first.items()}

    forced = lifecycle(config="micro", stages=STAGES, force=["tokenizer"])
    assert _status(forced) == {"data": "cached", "tokenizer": "ran", "tokens": "ran"}

    ws = Workspace.from_config(load_config("micro"))
    mlflow.set_tracking_uri(ws.tracking_uri)
    runs = mlflow.search_runs(experiment_names=["micro"], output_format="list")
    parents = [r for r in runs if r.data.tags.get("kind") == "lifecycle"]
    assert len(parents) == 3 and all(r.data.tags.get("prefect.flow_run_id") for r in parents)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    parent_ids = {r.info.run_id for r in parents}
    assert all(r.data.tags["mlflow.parentRunId"] in parent_ids for r in children)
    built = [r for r in children if r.data.tags.get("cached") != "true"]
    cached = [r for r in children if r.data.tags.get("cached") == "true"]
    # Runs that built something: first run 3; second none (cache hits); forced: tokenizer + tokens.
    assert sorted(r.data.tags["stage"] for r in built) == sorted(STAGES + ["tokenizer", "tokens"])
    # ... and every stage of every lifecycle run has a nested run: the cache hits' say so.
    assert sorted(r.data.tags["stage"] for r in cached) == sorted(STAGES + ["data"])
    client = mlflow.MlflowClient(ws.tracking_uri)
    exp = client.get_experiment_by_name("micro").experiment_id
    first_parent, second_parent, forced_parent = sorted(parents, key=lambda r: r.info.start_time)
    by_id = {r.info.run_id: r for r in built}
    by_parent: dict[str, dict[str, str]] = {}
    for run in cached:
        fp = run.data.tags["cached_fingerprint"]
        by_parent.setdefault(run.data.tags["mlflow.parentRunId"], {})[run.data.tags["stage"]] = fp
        assert "fingerprint" not in run.data.tags and run.info.status == "FINISHED"
        # It links the run that built the artifact: the first lifecycle's run of that stage and fingerprint.
        builder = by_id[run.data.tags["built_by_run_id"]]
        assert builder.data.tags["mlflow.parentRunId"] == first_parent.info.run_id
        assert (builder.data.tags["stage"], builder.data.tags["fingerprint"]) == (run.data.tags["stage"], fp)
        assert run.data.tags["artifact_uri"] == builder.data.tags["artifact_uri"]
        # The builder's figures (its final value of each metric) and config, read back from the builder.
        figures = {k: v for k, v in builder.data.metrics.items() if not k.startswith("system/")}
        assert figures and run.data.metrics == figures and run.data.params == builder.data.params
    # The second lifecycle run (all cache hits) has a cached nested run per stage, for the fingerprints it
    # used; the forced one, for data only.
    assert by_parent[second_parent.info.run_id] == {s: r["fingerprint"] for s, r in second.items()}
    assert by_parent[forced_parent.info.run_id] == {"data": forced["data"]["fingerprint"]}
    # Searching for the run that built an artifact (test_full_lifecycle's way) still finds only that one:
    # data was built once and is a cache hit in two lifecycle runs.
    fp = first["data"]["fingerprint"]
    found = client.search_runs([exp], f"tags.fingerprint = '{fp}' and attributes.status = 'FINISHED'")
    assert [r.data.tags["mlflow.parentRunId"] for r in found] == [first_parent.info.run_id]

def test_stage_alone_needs_upstream(micro_workdir):
    from flows.stages import STAGE_FLOWS
    from tasks.stage import MissingUpstream

    with pytest.raises(MissingUpstream, match="run `eightfold stage data` first"):
        STAGE_FLOWS["tokenizer"](config="micro")
