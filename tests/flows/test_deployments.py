"""Deployments against a real Prefect server and process worker: `eightfold deploy` registers the
scheduled lifecycle and one deployment per stage; a run triggered through the API fails once at an
injected fault after `data` committed; `prefect flow-run retry` (the UI's Retry) runs it again on the
worker and it completes with `data` a cache hit; a per-stage deployment then runs `tokens` alone on
the committed upstream artifacts. Server, worker and flow-run processes are stopped at the end."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fixtures.processes import free_port, start_process, stop_process_group, wait_flow_run_final, wait_healthy
from flows.deploy import KUBERNETES_POOL, PROCESS_POOL, ROOT, deploy_command, render_prefect_yaml
from stages.registry import STAGES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_prefect_yaml_matches_registry():
    """prefect.yaml (for `prefect deploy --all`) is the rendered deployment list: one per stage."""
    text = (ROOT / "prefect.yaml").read_text()
    assert text == render_prefect_yaml(), "prefect.yaml is stale: run `python -m flows.deploy > prefect.yaml`"
    deps = yaml.safe_load(text)["deployments"]
    entry = {d["entrypoint"] for d in deps if d["work_pool"]["name"] == PROCESS_POOL}
    assert entry == {"flows.lifecycle.lifecycle"} | {f"flows.stages.{s}_flow" for s in STAGES}
    scheduled = [d for d in deps if d["schedules"]]
    assert {d["entrypoint"] for d in scheduled} == {"flows.lifecycle.lifecycle"}
    assert {d["work_pool"]["name"] for d in scheduled} == {PROCESS_POOL, KUBERNETES_POOL}
    import flows.stages

    for s in STAGES:  # every entrypoint names a real flow object
        assert getattr(flows.stages, f"{s}_flow").name == f"stage-{s}"


def test_deploy_needs_an_api(monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert deploy_command() == 2
    assert "PREFECT_API_URL is not set" in capsys.readouterr().err


def test_a_pool_created_meanwhile_by_a_worker_is_used(monkeypatch):
    """`prefect worker start --pool P` creates P when it is missing, as `eightfold deploy` does: when
    both start at once, deploy's create is refused (409) and it takes the worker's pool instead of failing."""
    from types import SimpleNamespace

    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from rich.console import Console

    import flows.deploy as deploy

    class RacingClient:  # the worker creates the pool between deploy's read and its create
        def __init__(self):
            self.reads = 0

        def read_work_pool(self, name):
            self.reads += 1
            if self.reads == 1:
                raise ObjectNotFound(http_exc=None)
            return SimpleNamespace(name=name, type="process")

        def create_work_pool(self, pool):
            raise ObjectAlreadyExists(http_exc=None)

    monkeypatch.setattr(deploy, "_default_template", lambda pool_type: {})
    client = RacingClient()
    assert deploy._ensure_pool(client, PROCESS_POOL, None, Console(quiet=True)) == "process"
    assert client.reads == 2
    with pytest.raises(ValueError, match="exists with type 'process', not 'kubernetes'"):
        deploy._ensure_pool(RacingClient(), PROCESS_POOL, "kubernetes", Console(quiet=True))


def test_compose_file_is_consistent():
    """No Docker engine here: check what can be checked offline. Services named in depends_on exist,
    build files exist, the worker image holds every package, the pool names match `eightfold deploy`,
    the buckets the stores use are the ones created, and the deploy command's config override is valid."""
    import shlex
    import tomllib

    from infra.config import load_config

    here = ROOT / "infra" / "compose"
    doc = yaml.safe_load((here / "docker-compose.yml").read_text())
    services = doc["services"]
    for name, svc in services.items():
        assert set(svc.get("depends_on", {})) <= set(services), name
        if "build" in svc:
            assert (here / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file(), name
    dockerfile = (here / "worker.Dockerfile").read_text()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in packages:
        assert f"COPY {pkg.rstrip('*')} " in dockerfile, f"worker image misses package {pkg}"
    deploy = shlex.split(services["deploy"]["command"].replace("${EIGHTFOLD_CRON:-0 2 * * *}", "0 2 * * *")
                         .replace("${EIGHTFOLD_CONFIG:-configs/tiny.yaml}", "configs/tiny.yaml"))
    assert deploy[:2] == ["eightfold", "deploy"] and deploy[deploy.index("--pool") + 1] == PROCESS_POOL
    assert shlex.split(services["worker"]["command"])[4] == PROCESS_POOL
    store = deploy[deploy.index("--set") + 1]
    cfg = load_config(ROOT / deploy[deploy.index("--config") + 1], [store])
    buckets = services["buckets"]["entrypoint"]
    assert f"local/{cfg.infra.store.split('/')[2]}" in buckets
    assert "--artifacts-destination s3://mlflow/" in services["mlflow"]["command"] and "local/mlflow" in buckets
    env = services["worker"]["environment"]
    assert env["PREFECT_API_URL"].startswith("http://prefect-server:4200") and env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"


# --- a real server and worker ------------------------------------------------------------------


@pytest.fixture
def prefect_server(tmp_path, monkeypatch):
    """`prefect server start` on 127.0.0.1 with its own PREFECT_HOME; yields (api_url, env)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_LEVEL="INFO")
    server = start_process([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                            "--no-ui", "--analytics-off"], env, tmp_path / "server.log")
    try:
        wait_healthy(server, f"{api}/health", tmp_path / "server.log", timeout=120)
        env["PREFECT_API_URL"] = api
        monkeypatch.setenv("PREFECT_API_URL", api)
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield api, env
    finally:
        left = stop_process_group(server)
        assert not left, f"server processes left behind: {left}"


def _flow_run_log(client, run_id, expect: str | None = None, wait_s: float = 30.0) -> str:
    """The run's newest log lines (the API returns at most a page, oldest first unless asked), polled
    until `expect` shows up: a worker ships its last lines in a batch after the state changed."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    deadline = time.monotonic() + wait_s
    while True:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200,
                                sort=LogSort.TIMESTAMP_DESC)
        text = "\n".join(f"{log.level} {log.message}" for log in reversed(logs))[-4000:]
        if expect is None or expect in text or time.monotonic() > deadline:
            return text
        time.sleep(1)


def test_deploy_run_fail_retry_and_stage_run(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from infra.artifacts import list_artifacts
    from infra.store import open_store

    api, env = prefect_server
    t0 = time.monotonic()
    assert deploy_command(pool=PROCESS_POOL, cron="0 2 * * *", config="micro") == 0
    worker = start_process([sys.executable, "-m", "prefect", "worker", "start", "--pool", PROCESS_POOL, "--type", "process",
                     "--name", "test-worker"], {**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}, tmp_path / "worker.log")
    try:
        # A Kubernetes pool too (created with the kubernetes worker's default job template): only registered.
        assert deploy_command(pool=KUBERNETES_POOL, cron="none", config="micro", image="eightfold:test") == 0
        assert deploy_command(pool=KUBERNETES_POOL, config="micro") == 2  # no --image: a clear error
        with get_client(sync_client=True) as client:
            assert client.read_work_pool(PROCESS_POOL).type == "process"
            assert client.read_work_pool(KUBERNETES_POOL).type == "kubernetes"
            life = client.read_deployment_by_name(f"lifecycle/{PROCESS_POOL}")
            assert [s.schedule.cron for s in life.schedules] == ["0 2 * * *"]
            assert life.parameters["config"] == "micro"
            for s in STAGES:
                dep = client.read_deployment_by_name(f"stage-{s}/{PROCESS_POOL}")
                assert dep.entrypoint == f"flows.stages.{s}_flow" and not dep.schedules
            k8s = client.read_deployment_by_name(f"lifecycle/{KUBERNETES_POOL}")
            assert k8s.job_variables["image"] == "eightfold:test" and not k8s.schedules
        # prefect.yaml registers the same deployments through Prefect's own CLI (pools exist now).
        cli = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=ROOT, timeout=120,
                             env={**env, "PWD": str(ROOT), "EIGHTFOLD_IMAGE": "eightfold:yaml"},
                             capture_output=True, text=True)
        assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
        with get_client(sync_client=True) as client:
            life = client.read_deployment_by_name(f"lifecycle/{PROCESS_POOL}")
            assert life.parameters["config"] == "configs/tiny.yaml" and life.entrypoint == "flows.lifecycle.lifecycle"
            assert life.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
            k8s = client.read_deployment_by_name(f"lifecycle/{KUBERNETES_POOL}")
            assert k8s.job_variables["image"] == "eightfold:yaml" and k8s.schedules[0].schedule.cron == "0 2 * * *"
        print(f"deployed in {time.monotonic() - t0:.1f}s")

        work = tmp_path / "work"
        once = tmp_path / "fail-once"
        once.write_text("tokenizer fails while this file exists\n")
        run_env = {"EIGHTFOLD_WORKDIR": str(work), "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db",
                   "EIGHTFOLD_FAULT_FAIL_STAGE": "tokenizer", "EIGHTFOLD_FAULT_ONCE_FILE": str(once)}
        run = run_deployment(f"lifecycle/{PROCESS_POOL}", parameters={"config": "micro", "stages": ["data", "tokenizer"]},
                             job_variables={"env": run_env}, timeout=0)
        with get_client(sync_client=True) as client:
            failed = wait_flow_run_final(client, run.id, 120)
            assert failed.state.is_failed(), f"{failed.state}: {_flow_run_log(client, run.id)}"
            assert "injected fault" in _flow_run_log(client, run.id, expect="injected fault")
        print(f"first run failed at {time.monotonic() - t0:.1f}s")
        store = open_store(f"file://{work / 'artifacts'}")
        data_arts = list_artifacts(store, "micro", "data")
        assert not once.exists() and len(data_arts) == 1 and not list_artifacts(store, "micro", "tokenizer")

        # What the UI's Retry button does: the same flow run, scheduled again, picked up by the worker.
        retry = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", str(run.id)], env=env,
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        with get_client(sync_client=True) as client:
            done = wait_flow_run_final(client, run.id, 120)
            assert done.state.is_completed(), f"{done.state}: {_flow_run_log(client, run.id)}"
            assert done.run_count >= 2
        print(f"retried run completed at {time.monotonic() - t0:.1f}s")
        assert [a.fingerprint for a in list_artifacts(store, "micro", "data")] == [data_arts[0].fingerprint]
        tok = list_artifacts(store, "micro", "tokenizer")
        assert len(tok) == 1 and tok[0].inputs == {"data": data_arts[0].fingerprint}

        import mlflow

        runs = mlflow.MlflowClient(f"sqlite:///{work}/mlflow.db").search_runs(
            [mlflow.MlflowClient(f"sqlite:///{work}/mlflow.db").get_experiment_by_name("micro").experiment_id],
            order_by=["attributes.start_time ASC"])
        parents = [r for r in runs if r.data.tags.get("kind") == "lifecycle"]
        assert [p.info.status for p in parents] == ["FAILED", "FINISHED"]
        assert all(p.data.tags["prefect.flow_run_id"] == str(run.id) for p in parents)
        assert parents[1].data.tags["stage.data.status"] == "cached"
        assert parents[1].data.tags["stage.tokenizer.status"] == "ran"
        stage_runs = [(r.data.tags["stage"], r.info.status, r.data.tags.get("cached") == "true") for r in runs
                      if r.data.tags.get("stage")]
        # the retry's data stage is a cache hit: a nested run of its own, tagged cached (tasks/stage.py)
        assert stage_runs == [("data", "FINISHED", False), ("tokenizer", "FAILED", False),
                              ("data", "FINISHED", True), ("tokenizer", "FINISHED", False)]
        cached_data = next(r for r in runs if r.data.tags.get("cached") == "true")
        assert cached_data.data.tags["mlflow.parentRunId"] == parents[1].info.run_id
        assert cached_data.data.tags["built_by_run_id"] == data_arts[0].manifest["mlflow_run_id"]

        # Stage-by-stage triggering: `tokens` alone, on the latest committed data and tokenizer.
        clean_env = {k: v for k, v in run_env.items() if not k.startswith("EIGHTFOLD_FAULT")}
        srun = run_deployment(f"stage-tokens/{PROCESS_POOL}", parameters={"config": "micro"},
                              job_variables={"env": clean_env}, timeout=0)
        with get_client(sync_client=True) as client:
            sdone = wait_flow_run_final(client, srun.id, 120)
            assert sdone.state.is_completed(), f"{sdone.state}: {_flow_run_log(client, srun.id)}"
        tokens = list_artifacts(store, "micro", "tokens")
        assert len(tokens) == 1
        assert tokens[0].inputs == {"data": data_arts[0].fingerprint, "tokenizer": tok[0].fingerprint}
        print(f"stage run completed at {time.monotonic() - t0:.1f}s")
    finally:
        left = stop_process_group(worker)
        assert not left, f"worker processes left behind: {left}"
