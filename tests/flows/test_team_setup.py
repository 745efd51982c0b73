"""README's team set-up without Docker, run for real: PostgreSQL (Debian's package), the Prefect server and
the MLflow server on it (MLflow's artifacts proxied to the local S3 endpoint), a process worker on a work
pool, the deployments registered with `eightfold deploy`, and the micro lifecycle run twice through the
lifecycle deployment with `infra.store=s3://...`. Then every stage's artifact is in S3, every run is in
MLflow (the second lifecycle's stages as cached runs), and the real UIs, rendered by headless Chromium,
show every stage, its artifact and its figures; the screenshots are kept (fixtures/browser.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.processes import free_port, start_process, stop_process_group, wait_flow_run_final, wait_healthy
from fixtures.browser import chromium  # noqa: F401
from fixtures.postgres import new_database, postgres_url  # noqa: F401
from fixtures.s3 import new_bucket_name, s3_endpoint  # noqa: F401
from flows.deploy import PROCESS_POOL, ROOT
from stages.registry import STAGES

# two micro lifecycles through a worker, on 2 cores: a few minutes; the module's first test pays
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

EXPERIMENT = "micro"


@dataclass
class Team:
    prefect_api: str  # http://127.0.0.1:PORT/api; the UI is at the same host and port
    mlflow_url: str
    store: str  # s3://BUCKET/artifacts
    s3_endpoint: str
    mlflow_bucket: str
    flow_runs: list[str]  # the two lifecycle flow runs, oldest first
    work: Path

    @property
    def prefect_ui(self) -> str:
        return self.prefect_api.removesuffix("/api")


@pytest.fixture(scope="module")
def team(tmp_path_factory, postgres_url, s3_endpoint):  # noqa: F811
    import boto3
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root = tmp_path_factory.mktemp("team")
    bucket, mlflow_bucket = new_bucket_name(), new_bucket_name()
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for b in (bucket, mlflow_bucket):
        s3.create_bucket(Bucket=b)
    prefect_port, mlflow_port = free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_HOME=str(root / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_API_URL=api, PREFECT_UI_API_URL=api)  # the UI calls the API on 4200 unless told
    procs: list[subprocess.Popen] = []
    try:
        prefect_db = new_database(postgres_url, "prefect").replace("postgresql://", "postgresql+asyncpg://")
        server_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL": prefect_db}
        procs.append(start_process([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(prefect_port), "--analytics-off"], server_env, root / "prefect.log"))
        mlflow_env = {**env, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        procs.append(start_process([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                             "--backend-store-uri", new_database(postgres_url, "mlflow"),
                             "--artifacts-destination", f"s3://{mlflow_bucket}/mlflow", "--workers", "1"],
                            mlflow_env, root / "mlflow.log"))
        wait_healthy(procs[0], f"{api}/health", root / "prefect.log")
        wait_healthy(procs[1], f"{mlflow_url}/health", root / "mlflow.log")

        store = f"s3://{bucket}/artifacts"
        settings = [f"infra.store={store}", f"infra.s3_endpoint_url={s3_endpoint}", f"infra.tracking_uri={mlflow_url}"]
        deploy = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--pool", PROCESS_POOL, "--cron", "none",
                                 "--config", "micro", *[a for s in settings for a in ("--set", s)]],
                                env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        work = root / "work"  # the worker's scratch; the artifacts go to S3
        procs.append(start_process([sys.executable, "-m", "prefect", "worker", "start", "--pool", PROCESS_POOL,
                             "--type", "process", "--name", "team-worker"],
                            {**env, "PREFECT_WORKER_QUERY_SECONDS": "1", "EIGHTFOLD_WORKDIR": str(work)},
                            root / "worker.log"))
        flow_runs = []
        with temporary_settings(updates={PREFECT_API_URL: api}):
            for _ in range(2):  # the second run: every stage a cache hit
                run = run_deployment(f"lifecycle/{PROCESS_POOL}", timeout=0)
                with get_client(sync_client=True) as client:
                    done = wait_flow_run_final(client, run.id, 1200)
                assert done.state.is_completed(), f"{done.state}:\n{(root / 'worker.log').read_text()[-6000:]}"
                flow_runs.append(str(run.id))
            yield Team(api, mlflow_url, store, s3_endpoint, mlflow_bucket, flow_runs, work)
    finally:
        left = [p for proc in reversed(procs) for p in stop_process_group(proc)]
        assert not left, f"processes left behind: {left}"


def _workspace(team: Team):
    from infra.config import load_config
    from infra.workspace import Workspace

    return Workspace.from_config(load_config("micro", [f"infra.store={team.store}", f"infra.s3_endpoint_url={team.s3_endpoint}",
                                                      f"infra.tracking_uri={team.mlflow_url}"]))


def _lifecycle_runs(team: Team):
    """(experiment id, the two lifecycle parent runs oldest first, every stage run by parent id)."""
    from mlflow import MlflowClient

    client = MlflowClient(team.mlflow_url)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("kind") == "lifecycle"]
    children: dict[str, list] = {}
    for r in runs:
        if parent := r.data.tags.get("mlflow.parentRunId"):
            children.setdefault(parent, []).append(r)
    return exp, parents, children


def test_every_stage_artifact_is_in_s3(team):
    """Each stage committed one artifact, in the S3 store and nowhere on the worker's disk, and the stage
    runs of the first lifecycle name exactly those artifacts."""
    from infra.artifacts import find_artifact, list_artifacts

    ws = _workspace(team)
    assert ws.store.uri == team.store
    _, parents, children = _lifecycle_runs(team)
    built = {r.data.tags["stage"]: r for r in children[parents[0].info.run_id] if r.data.tags.get("stage") in STAGES}
    assert set(built) == set(STAGES)
    for stage in STAGES:
        arts = [a for a in list_artifacts(ws.store, EXPERIMENT, stage) if a.stage == stage]  # not the sweep's proxies
        assert [a.fingerprint for a in arts] == [built[stage].data.tags["fingerprint"]], stage
        art = find_artifact(ws.store, EXPERIMENT, stage, arts[0].fingerprint)
        assert art.uri.startswith(team.store + "/") and art.manifest["files"], stage
    assert not (team.work / "artifacts").exists()


def test_every_run_is_in_mlflow(team):
    """Two lifecycle runs (one per flow run) FINISHED; the first built every stage in a nested run; the
    second ran none; the experiment opens in MLflow's training view; the runs' own artifacts (the
    evaluation table, plots) went through the server to S3."""
    import boto3
    from mlflow import MlflowClient

    exp, parents, children = _lifecycle_runs(team)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    assert [p.data.tags["prefect.flow_run_id"] for p in parents] == team.flow_runs
    assert [p.info.status for p in parents] == ["FINISHED", "FINISHED"]
    first = [r for r in children[parents[0].info.run_id] if r.data.tags.get("stage") in STAGES]
    assert sorted(r.data.tags["stage"] for r in first) == sorted(STAGES)
    assert {r.info.status for r in first} == {"FINISHED"}
    assert all(parents[1].data.tags[f"stage.{s}.status"] == "cached" for s in STAGES)

    client = MlflowClient(team.mlflow_url)
    evaluate = next(r for r in first if r.data.tags["stage"] == "evaluate")
    logged = [f.path for f in client.list_artifacts(evaluate.info.run_id)]
    assert logged, "the evaluate run logged no artifacts"
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=team.s3_endpoint)
            .list_objects_v2(Bucket=team.mlflow_bucket).get("Contents", [])]
    assert any(evaluate.info.run_id in k for k in keys), keys[:10]


def test_the_uis_show_every_stage(team, chromium):
    """What a user opens, rendered by headless Chromium (screenshots kept, fixtures/browser.py):
    - Prefect, the first flow run: its Task Runs tab lists a task run per stage, tagged with the stage;
      its Artifacts tab has every stage's artifact and figures table;
    - Prefect, the second flow run: every stage's task run is Cached;
    - MLflow's compare page of both lifecycles' stage runs: a column per stage in each lifecycle, with
      the artifact it built or reused and its figures;
    - the MLflow link a stage's Prefect artifact gives opens that run in the training view."""
    import json
    from urllib.parse import quote

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from fixtures.browser import rendered_text, screenshot
    from infra.tracking import ui_url

    def task_runs(flow_run: str) -> list:
        with temporary_settings(updates={PREFECT_API_URL: team.prefect_api}), get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run])))
        return [t for t in runs if any(tag.startswith("stage:") for tag in t.tags)]

    first, second = team.flow_runs
    shots = []
    built = task_runs(first)
    assert sorted(t.name.rsplit("-", 1)[0] for t in built) == sorted(STAGES)
    rendered_text(chromium, f"{team.prefect_ui}/runs/flow-run/{first}", [t.name for t in built] +
                  [f"stage:{s}" for s in STAGES], click="li.p-tab#task-runs")
    shots.append(screenshot(chromium, "prefect-flow-run-task-runs"))
    keys = [f"{EXPERIMENT}-{s}" for s in STAGES] + [f"{EXPERIMENT}-{s}-figures" for s in STAGES]
    rendered_text(chromium, f"{team.prefect_ui}/runs/flow-run/{first}", keys, click="li.p-tab#artifacts")
    shots.append(screenshot(chromium, "prefect-flow-run-artifacts"))

    cached = task_runs(second)
    assert {t.state.name for t in cached} == {"Cached"}
    text = rendered_text(chromium, f"{team.prefect_ui}/runs/flow-run/{second}", [t.name for t in cached],
                         click="li.p-tab#task-runs")
    assert text.count("Cached") >= len(STAGES), text[:3000]
    shots.append(screenshot(chromium, "prefect-cached-flow-run-task-runs"))

    exp, parents, children = _lifecycle_runs(team)
    stage_runs = [r for p in parents for r in children[p.info.run_id] if r.data.tags.get("stage") in STAGES]
    assert len(stage_runs) == 2 * len(STAGES)
    ids, exps = quote(json.dumps([r.info.run_id for r in stage_runs])), quote(json.dumps([exp.experiment_id]))
    figures = {r.info.run_id: sorted(k for k in r.data.metrics if not k.startswith("system/")) for r in stage_runs}
    assert all(figures.values()), [r.info.run_name for r in stage_runs if not figures[r.info.run_id]]
    figures = [names[0] for names in figures.values()]  # one row per run: the page has them all
    expect = [r.info.run_name for r in stage_runs] + [r.data.tags["artifact_uri"] for r in stage_runs] + figures
    rendered_text(chromium, ui_url(team.mlflow_url, f"#/compare-runs?runs={ids}&experiments={exps}"), expect,
                  scroll=".ReactVirtualized__Grid", timeout=120)  # the params and metrics tables
    shots.append(screenshot(chromium, "mlflow-compare-two-lifecycles"))

    with temporary_settings(updates={PREFECT_API_URL: team.prefect_api}), get_client(sync_client=True) as client:
        links = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[first])))
    link = next(a.data for a in links if a.key == f"{EXPERIMENT}-pretrain-mlflow-run")
    url = link[link.index("(") + 1:link.rindex(")")] if link.startswith("[") else link  # stored as markdown
    pretrain = next(r for r in stage_runs if r.data.tags["stage"] == "pretrain" and "cached" not in r.data.tags)
    text = rendered_text(chromium, url, [pretrain.info.run_name, "Model metrics", *sorted(pretrain.data.metrics)[:3]])
    assert "Model training" in text and "Traces\nSessions" not in text  # the training view's menu, not GenAI's
    shots.append(screenshot(chromium, "mlflow-pretrain-run"))
    print("screenshots:", *shots, sep="\n  ")
