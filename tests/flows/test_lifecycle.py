"""The lifecycle flow on the micro config: stages run in order, a second run is all cache hits, a
forced stage re-runs only itself and what reads it, and MLflow holds one parent run with a nested
run per stage."""

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
    # first run: 3 stage runs; second: none (cache hits); forced: tokenizer + tokens.
    assert sorted(r.data.tags["stage"] for r in children) == sorted(STAGES + ["tokenizer", "tokens"])
    parent_ids = {r.info.run_id for r in parents}
    assert all(r.data.tags["mlflow.parentRunId"] in parent_ids for r in children)


def test_stage_alone_needs_upstream(micro_workdir):
    from flows.stages import STAGE_FLOWS
    from tasks.stage import MissingUpstream

    with pytest.raises(MissingUpstream, match="run `eightfold stage data` first"):
        STAGE_FLOWS["tokenizer"](config="micro")
