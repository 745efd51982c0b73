"""MLflow tracking: nested lifecycle/stage runs read back with `mlflow.search_runs`, against the
default sqlite file and against a real `mlflow server` on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from infra.config import load_config
from infra.tracking import MAX_PARAM_VALUE, RunLogger, Tracker, flatten_params
from infra.workspace import Workspace


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    """One database for the module: creating a fresh one costs ~2.5 s of schema migrations."""
    return f"sqlite:///{tmp_path_factory.mktemp('tracking') / 'wd' / 'mlflow.db'}"


@pytest.fixture(params=["sqlite", "server"])
def tracking_uri(request, sqlite_uri):
    if request.param == "sqlite":
        return sqlite_uri
    return request.getfixturevalue("mlflow_server")


@pytest.fixture
def search_uri(tracking_uri):
    """mlflow.search_runs reads the global tracking URI: point it at ours for the test only."""
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    yield tracking_uri
    mlflow.set_tracking_uri(before)


def test_flatten_params_dotted_lists_and_truncation():
    flat = flatten_params({"model": {"dim": 128, "moe": None, "rope": {"theta": 1e4}}, "tags": [1, 2], "x": "y" * 7000})
    assert flat["model.dim"] == "128"
    assert flat["model.moe"] == "None"
    assert flat["model.rope.theta"] == "10000.0"
    assert flat["tags"] == "[1,2]"
    assert len(flat["x"]) == MAX_PARAM_VALUE
    assert set(flat) == {"model.dim", "model.moe", "model.rope.theta", "tags", "x"}


def test_nested_runs_read_back(search_uri, tmp_path, request):
    cfg = load_config("tiny")
    experiment = f"exp-{request.node.callspec.id}-{tmp_path.name}"
    tracker = Tracker(search_uri, experiment)
    artifact = tmp_path / "summary.md"
    artifact.write_text("# tokenizer\nvocab 4096\n")

    with tracker.lifecycle_run("lifecycle", tags={"config": "tiny"}, flow_run_id="flow-123") as parent:
        with tracker.stage_run("data", "fp-data", parent, params=cfg.data.model_dump(mode="json")) as data_run:
            for step in range(5):
                tracker.log_metrics(data_run, {"loss": 10.0 / (step + 1), "lr": 1e-3 * step}, step=step)
            tracker.log_artifact(data_run, artifact, "reports")
            tracker.log_text(data_run, "hello", "notes/hello.txt")
        with pytest.raises(RuntimeError, match="boom"):
            with tracker.stage_run("tokenizer", "fp-tok", parent, params={"tokenizer": {"vocab_size": 4096}}):
                raise RuntimeError("boom")

    runs = mlflow.search_runs(experiment_names=[experiment], output_format="list")
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == {"lifecycle", "data", "tokenizer"}
    p, d, t = by_name["lifecycle"], by_name["data"], by_name["tokenizer"]
    assert p.info.run_id == parent and d.info.run_id == data_run
    assert p.data.tags["prefect.flow_run_id"] == "flow-123" and p.data.tags["config"] == "tiny"
    assert "mlflow.parentRunId" not in p.data.tags
    assert d.data.tags["mlflow.parentRunId"] == parent == t.data.tags["mlflow.parentRunId"]
    assert (d.data.tags["stage"], d.data.tags["fingerprint"]) == ("data", "fp-data")
    assert (t.data.tags["stage"], t.data.tags["fingerprint"]) == ("tokenizer", "fp-tok")
    assert (p.info.status, d.info.status, t.info.status) == ("FINISHED", "FINISHED", "FAILED")
    # Params are the flattened config section, read back as strings.
    assert d.data.params == flatten_params(cfg.data.model_dump(mode="json"))
    assert t.data.params["tokenizer.vocab_size"] == "4096"

    children = mlflow.search_runs(
        experiment_names=[experiment], filter_string=f"tags.mlflow.parentRunId = '{parent}'", output_format="pandas"
    )
    assert sorted(children["tags.stage"]) == ["data", "tokenizer"]

    client = MlflowClient(search_uri)
    history = client.get_metric_history(data_run, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(s, 10.0 / (s + 1)) for s in range(5)]
    got = client.download_artifacts(data_run, "reports/summary.md", str(tmp_path / "dl"))
    assert open(got).read() == artifact.read_text()
    got = client.download_artifacts(data_run, "notes/hello.txt", str(tmp_path / "dl"))
    assert open(got).read() == "hello"


def test_experiment_opens_in_the_training_view(sqlite_uri, tmp_path):
    """MLflow 3's UI shows an experiment as GenAI (traces) unless it is tagged as model development;
    ours are tagged when created, and one made elsewhere without the tag gets it on first use."""
    from infra.tracking import EXPERIMENT_KIND

    client = MlflowClient(sqlite_uri)
    made_here = Tracker(sqlite_uri, f"kind-new-{tmp_path.name}").experiment_id
    foreign = client.create_experiment(f"kind-old-{tmp_path.name}")
    assert client.get_experiment(foreign).tags.get(EXPERIMENT_KIND[0]) is None
    assert Tracker(sqlite_uri, f"kind-old-{tmp_path.name}").experiment_id == foreign
    for exp_id in (made_here, foreign):
        assert client.get_experiment(exp_id).tags[EXPERIMENT_KIND[0]] == "custom_model_development"


def test_cached_stage_run_copies_and_links_its_builder(tracking_uri, tmp_path, caplog):
    tracker = Tracker(tracking_uri, f"cached-{tmp_path.name}")
    with tracker.lifecycle_run("lifecycle-1") as first:
        with tracker.stage_run("pretrain", "fp-pre", first, params={"pretrain": {"lr": 3e-3}}) as built:
            for step in (1, 2, 3):
                tracker.log_metrics(built, {"loss": 4.0 - step}, step=step)
            tracker.log_metrics(built, {"val_loss": 1.5, "system/cpu_utilization_percentage": 50.0}, step=3)
    with tracker.lifecycle_run("lifecycle-2") as second:
        cached = tracker.cached_stage_run("pretrain", "fp-pre", second, built, "file:///store/pretrain/fp-pre")
        with caplog.at_level("WARNING", logger="infra.tracking"):
            orphan = tracker.cached_stage_run("data", "fp-data", second, "0" * 32, "file:///store/data/fp-data")
    client = MlflowClient(tracking_uri)
    run, source = client.get_run(cached), client.get_run(built)
    tags = run.data.tags
    assert (run.info.status, tags["mlflow.parentRunId"], tags["stage"], tags["cached"]) == \
        ("FINISHED", second, "pretrain", "true")
    assert tags["built_by_run_id"] == built and tags["cached_fingerprint"] == "fp-pre" and "fingerprint" not in tags
    assert tags["artifact_uri"] == "file:///store/pretrain/fp-pre" and built in tags["mlflow.note.content"]
    if tracking_uri.startswith("http"):  # the builder's page, where a server can show it
        assert tags["built_by_run_url"] == tracker.run_url(built) and tags["built_by_run_url"].startswith("http")
    else:
        assert "built_by_run_url" not in tags
    # The builder's final figure of each metric, at its step; its machine's system metrics are not copied.
    assert run.data.metrics == {"loss": 1.0, "val_loss": 1.5}
    assert [(m.step, m.value) for m in client.get_metric_history(cached, "loss")] == [(3, 1.0)]
    assert run.data.params == source.data.params == {"pretrain.lr": "0.003"}
    # A builder that cannot be read: the run is still there, linked, with a warning and nothing copied.
    lost = client.get_run(orphan)
    assert lost.data.tags["built_by_run_id"] == "0" * 32 and not lost.data.metrics and lost.info.status == "FINISHED"
    assert "cannot be read" in caplog.text
    # Searching by fingerprint finds the builder alone.
    found = client.search_runs([tracker.experiment_id], "tags.fingerprint = 'fp-pre'")
    assert [r.info.run_id for r in found] == [built]


def test_runlogger_buffers_and_flushes(search_uri, tmp_path):
    tracker = Tracker(search_uri, f"runlogger-{tmp_path.name}")
    run_id = tracker.start_run("pretrain")
    client = MlflowClient(search_uri)
    with RunLogger(search_uri, run_id, flush_every=6, flush_seconds=3600) as logger:
        for step in range(4):  # 8 values: one flush at 6, two left in the buffer
            logger.log_metrics({"loss": float(step), "grad_norm": step * 0.5}, step=step)
        assert len(client.get_metric_history(run_id, "loss")) == 3
        logger.log_params({"pretrain": {"lr": 3e-3}})
    assert [m.value for m in sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)] == [0, 1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, "grad_norm")] == [0, 1, 2, 3]
    assert client.get_run(run_id).data.params["pretrain.lr"] == "0.003"
    # The time trigger: with flush_seconds=0 every call is sent at once, whatever the count.
    timed = RunLogger(search_uri, run_id, flush_every=10**6, flush_seconds=0.0)
    timed.log_metrics({"tokens_per_s": 123.0}, step=7)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "tokens_per_s")] == [(7, 123.0)]
    timed.close()


def test_runlogger_noop_and_survives_errors(sqlite_uri, caplog):
    off = RunLogger(None, None)
    off.log_metrics({"loss": 1.0}, step=1)
    off.log_params({"a": 1})
    off.close()
    assert off._client is None

    bad = RunLogger(sqlite_uri, "0" * 32, flush_every=1)  # a run id that does not exist
    bad.log_metrics({"loss": 1.0}, step=0)  # must not raise inside a training loop
    assert len(bad._buffer) == 1 and "failed" in caplog.text
    bad.close()
    assert bad.dropped == 1


def test_default_artifact_location_is_the_workdir(sqlite_uri, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    workdir = Path(sqlite_uri.removeprefix("sqlite:///")).parent  # reuse the module's database
    cfg = load_config("tiny", [f"infra.workdir={workdir}", "name=wsexp"])
    ws = Workspace.from_config(cfg)
    assert ws.tracking_uri == sqlite_uri
    tracker = Tracker.for_workspace(ws)
    exp = tracker.client.get_experiment(tracker.experiment_id)
    assert exp.name == "wsexp"
    assert exp.artifact_location == (workdir / "mlflow-artifacts").as_uri()
    assert Tracker(ws.tracking_uri, "wsexp").experiment_id == tracker.experiment_id  # get, not create twice
    run_id = tracker.start_run("x")
    tracker.log_text(run_id, "in the workdir", "a.txt")
    assert (workdir / "mlflow-artifacts" / run_id / "artifacts" / "a.txt").read_text() == "in the workdir"


@pytest.mark.s3
def test_artifacts_in_s3(sqlite_uri, s3_endpoint, monkeypatch, tmp_path):
    """An s3:// artifact_location (here the local S3 endpoint) holds the run's artifacts."""
    import boto3

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_endpoint)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="mlflow-art")
    tracker = Tracker(sqlite_uri, f"s3-{tmp_path.name}", artifact_location="s3://mlflow-art/runs")
    run_id = tracker.start_run("export")
    tracker.log_text(run_id, "weights table", "eval/table.md")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="mlflow-art")["Contents"]]
    assert keys == [f"runs/{run_id}/artifacts/eval/table.md"]
    got = MlflowClient(sqlite_uri).download_artifacts(run_id, "eval/table.md", str(tmp_path))
    assert open(got).read() == "weights table"
