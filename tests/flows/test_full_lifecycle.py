"""The whole lifecycle on the micro config, through Prefect, as a team runs it on a cluster whose nodes
share nothing but the object store: README's team set-up for real (PostgreSQL, the Prefect server and
the MLflow server on it, MLflow's artifacts proxied to a local S3 server, a process worker,
`eightfold deploy`, fixtures/team.py), the lifecycle deployment run twice with artifacts in S3 and every
training job on two nodes (the local launcher's simulated nodes, each with a folder of its own), every
file a rank writes audited, and no path written by both nodes. Then: every stage's artifact is in S3,
every run in MLflow (the second lifecycle's stages as cached runs), the real UIs rendered by headless
Chromium show every stage, its artifact and its figures (screenshots kept); a forced stage re-runs only
itself and what reads it; a training job killed mid-run is retried by the task from its checkpoint in
the store and ends with the same weights as the uninterrupted run; and a diverging job is rolled back one
checkpoint, relaunched at a lower LR and completes, or, with no rollback budget, fails without burning
its retries. Those last ones run in this process against the same servers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from fixtures.browser import chromium  # noqa: F401
from fixtures.postgres import postgres_url  # noqa: F401
from fixtures.s3 import new_bucket_name, s3_endpoint  # noqa: F401
from fixtures.team import Team, team_services
from infra.artifacts import find_artifact, list_artifacts
from infra.config import load_config
from infra.workspace import Workspace
from stages.registry import STAGES

# the module's first test pays for the servers and two lifecycles (its fixture): a few minutes on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# no retry delay; checkpoints saved synchronously, so the one before the fault is committed for sure; no
# pre-flight check (the fixture's first lifecycle ran one before each training stage)
FAST_RETRY = ["infra.retry_delay_s=0", "pretrain.checkpoint.async_save=false", "infra.health_check=false"]
CONFIG: str = ""  # the micro config on S3, the team's MLflow and two nodes, written by the fixture
EXPERIMENT = "micro"


@dataclass
class MicroRun:
    team: Team
    store: str  # s3://BUCKET/artifacts
    work: Path  # the worker's scratch (and this process's, for the tests that run flows here)
    audit: Path


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory, postgres_url, s3_endpoint):  # noqa: F811
    import boto3
    from prefect.settings import PREFECT_API_URL, temporary_settings

    global CONFIG
    root = tmp_path_factory.mktemp("lifecycle")
    work, audit = root / "work", root / "audit"
    bucket = new_bucket_name()
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    worker_env = {"EIGHTFOLD_WORKDIR": str(work), "EIGHTFOLD_AUDIT_WRITES": str(audit)}  # trainer/audit.py
    with team_services(root, postgres_url, s3_endpoint, worker_env) as team:
        cfg = load_config("micro").model_dump(mode="json")
        cfg["infra"].update(store=f"s3://{bucket}/artifacts", s3_endpoint_url=s3_endpoint, tracking_uri=team.mlflow_url)
        cfg["parallel"].update(nnodes=2, nproc_per_node=1, dp=2)
        # a training job that hangs is cancelled and retried within minutes, not at the test's timeout
        cfg["infra"]["task_timeout_s"] = {t: 300 for t in ("pretrain", "posttrain-sft", "posttrain-dpo", "posttrain-grpo",
                                                          "posttrain-rm", "posttrain-ppo")}
        CONFIG = str(root / "micro-s3-two-nodes.yaml")
        Path(CONFIG).write_text(yaml.safe_dump(cfg))
        team.deploy(CONFIG)
        try:
            for _ in range(2):  # the second: every stage a cache hit
                team.run_lifecycle()
        except BaseException:
            _print_job_logs(work)
            raise
        _print_retries(root / "worker.log", work)
        with pytest.MonkeyPatch.context() as mp, temporary_settings(updates={PREFECT_API_URL: team.prefect_api}):
            mp.setenv("EIGHTFOLD_WORKDIR", str(work))
            mp.delenv("MLFLOW_TRACKING_URI", raising=False)
            yield MicroRun(team, cfg["infra"]["store"], work, audit)


def _print_job_logs(work: Path, last: int = 30) -> None:
    """The last lines of every training job's log (each node's and the launcher's): what CI shows of a
    failed lifecycle."""
    for log in sorted(work.rglob("logs/*.log")):
        lines = log.read_text(errors="replace").splitlines()[-last:]
        print(f"--- {log.relative_to(work)} (last {len(lines)} lines) ---", *lines, sep="\n")


def _print_retries(worker_log: Path, work: Path) -> None:
    """A task the worker retried (a clean lifecycle retries none) or a job cancelled after it completed
    (stuck in its shutdown): those lines and the jobs' logs, which CI shows beside any failing test."""
    lines = worker_log.read_text(errors="replace").splitlines()
    retried = [line for line in lines if "Retry " in line or "cancelled them" in line]
    if retried:
        print("--- tasks retried, jobs cancelled ---", *retried, sep="\n")
        _print_job_logs(work, last=200)  # a cancelled rank's stacks come before its agent's own traceback


def _ws() -> Workspace:
    return Workspace.from_config(load_config(CONFIG))


def _status(result):
    return {stage: ("cached" if ref["cached"] else "ran") for stage, ref in result.items()}


def _folder(ws: Workspace, stage: str, fp: str) -> Path:
    """A verified local copy of a committed artifact."""
    art = find_artifact(ws.store, ws.experiment, stage, fp)
    return art.download(ws.path("test-copies", stage, fp))


def _weights(ws: Workspace, stage: str, fp: str) -> dict[str, torch.Tensor]:
    from stages.export.merge import find_checkpoint, load_full_state_dict

    return load_full_state_dict(find_checkpoint(_folder(ws, stage, fp)))


def _attempts(ws: Workspace, stage: str, fp: str) -> list[dict]:
    art = find_artifact(ws.store, ws.experiment, stage, fp)
    return art.store.get_json(art.key("attempts.json"))


def _stage_metrics(ws: Workspace, fp: str) -> dict[str, list]:
    """Every metric history of the (successful) pretrain MLflow run of this fingerprint."""
    client = mlflow.MlflowClient(ws.tracking_uri)
    exp = client.get_experiment_by_name(ws.experiment).experiment_id
    runs = client.search_runs([exp], f"tags.fingerprint = '{fp}' and attributes.status = 'FINISHED'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    return {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}


def _lifecycle_runs(run: MicroRun):
    """(experiment, the deployment's two lifecycle parent runs oldest first, stage runs by parent id)."""
    client = mlflow.MlflowClient(run.team.mlflow_url)
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("kind") == "lifecycle"
               and r.data.tags.get("prefect.flow_run_id") in run.team.flow_runs[:2]]
    children: dict[str, list] = {}
    for r in runs:
        if r.data.tags.get("stage") in STAGES and (parent := r.data.tags.get("mlflow.parentRunId")):
            children.setdefault(parent, []).append(r)
    return exp, parents, children


def _first_fingerprints(run: MicroRun) -> dict[str, str]:
    """Each stage's fingerprint, from the runs that built them in the first lifecycle."""
    _, parents, children = _lifecycle_runs(run)
    return {r.data.tags["stage"]: r.data.tags["fingerprint"] for r in children[parents[0].info.run_id]}


def test_no_path_is_written_by_both_nodes(micro_run):
    """Every training job (proxies aside: one node) ran on two node folders; the ranks' writes (files
    opened for writing, rename targets) name no path outside the store that both nodes wrote."""
    by_node: dict[str, set[str]] = {}
    for f in micro_run.audit.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            by_node.setdefault(Path(rec["node"]).name, set()).add(rec["path"])
    assert {"node0", "node1"} <= set(by_node), sorted(by_node)
    assert by_node["node0"] and by_node["node1"]
    assert not by_node["node0"] & by_node["node1"], sorted(by_node["node0"] & by_node["node1"])[:5]
    # the store is S3: nothing of the artifacts is on this machine's disk
    assert not (micro_run.work / "artifacts").exists()


def test_every_stage_ran_then_was_cached_and_is_in_s3(micro_run):
    """The first lifecycle built every stage, each one artifact in the S3 store; the second built none
    and reused the same fingerprints; the export ships the last post-train model and, for the table,
    every earlier one."""
    _, parents, children = _lifecycle_runs(micro_run)
    assert [p.data.tags["prefect.flow_run_id"] for p in parents] == micro_run.team.flow_runs[:2]
    first, second = parents
    assert {s: first.data.tags[f"stage.{s}.status"] for s in STAGES} == {s: "ran" for s in STAGES}
    assert {s: second.data.tags[f"stage.{s}.status"] for s in STAGES} == {s: "cached" for s in STAGES}
    built = _first_fingerprints(micro_run)
    reused = {r.data.tags["stage"]: r.data.tags["cached_fingerprint"] for r in children[second.info.run_id]}
    assert set(built) == set(STAGES) and reused == built
    ws = _ws()
    assert ws.store.uri == micro_run.store
    for stage in STAGES:
        arts = [a for a in list_artifacts(ws.store, EXPERIMENT, stage) if a.stage == stage]  # not the sweep's proxies
        assert [a.fingerprint for a in arts] == [built[stage]], stage
        assert arts[0].uri.startswith(micro_run.store + "/") and arts[0].manifest["files"], stage
    summary = json.loads((_folder(ws, "export", built["export"]) / "export.json").read_text())
    # both branches (micro's posttrain.chain): GRPO's model ships, PPO's is exported beside it
    assert summary["source"] == "posttrain-grpo" and set(summary["lineage"]) == {"pretrain", "sft", "ppo", "dpo"}
    table = json.loads((_folder(ws, "evaluate", built["evaluate"]) / "evaluation.json").read_text())
    rows = [r["variant"] for r in table["rows"]]
    assert rows[:5] == ["pretrain", "sft", "ppo", "dpo", "grpo"] and len(rows) > 5, rows


def test_every_run_is_in_mlflow(micro_run):
    """Both lifecycle runs FINISHED, each with a nested run per stage (the second's tagged cached, linking
    the builder); the experiment is a training one; the runs' own artifacts (the evaluation table, plots)
    went through the server to S3."""
    import boto3

    exp, parents, children = _lifecycle_runs(micro_run)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    assert [p.info.status for p in parents] == ["FINISHED", "FINISHED"]
    first, second = (children[p.info.run_id] for p in parents)
    assert sorted(r.data.tags["stage"] for r in first) == sorted(r.data.tags["stage"] for r in second) == sorted(STAGES)
    assert {r.info.status for r in first + second} == {"FINISHED"}
    builders = {r.info.run_id for r in first}
    assert all(r.data.tags["cached"] == "true" and r.data.tags["built_by_run_id"] in builders for r in second)

    client = mlflow.MlflowClient(micro_run.team.mlflow_url)
    evaluate = next(r for r in first if r.data.tags["stage"] == "evaluate")
    assert [f.path for f in client.list_artifacts(evaluate.info.run_id)], "the evaluate run logged no artifacts"
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=micro_run.team.s3_endpoint)
            .list_objects_v2(Bucket=micro_run.team.mlflow_bucket).get("Contents", [])]
    assert any(evaluate.info.run_id in k for k in keys), keys[:10]
    # every exported variant a model version of the export run, naming its checkpoint where any node reads it
    export = next(r for r in first if r.data.tags["stage"] == "export")
    versions = client.search_model_versions(f"name = '{EXPERIMENT}'")
    assert versions and {v.run_id for v in versions} == {export.info.run_id}
    assert all(v.tags["checkpoint"].startswith(micro_run.store + "/") for v in versions), \
        [v.tags["checkpoint"] for v in versions]


def test_the_uis_show_every_stage(micro_run, chromium):  # noqa: F811
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

    team = micro_run.team
    first, second = team.flow_runs[:2]
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

    exp, parents, children = _lifecycle_runs(micro_run)
    stage_runs = [r for p in parents for r in children[p.info.run_id]]
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

    # The experiment, as `eightfold` links it: its training runs, not the GenAI overview (traces, usage).
    text = rendered_text(chromium, ui_url(team.mlflow_url, f"#/experiments/{exp.experiment_id}"),
                         [p.info.run_name for p in parents])
    assert "Usage\nQuality" not in text
    shots.append(screenshot(chromium, "mlflow-experiment-runs"))
    # The registry: the shipped model's version holds @champion (evaluate's gates passed), every variant listed.
    versions = mlflow.MlflowClient(team.mlflow_url).search_model_versions(f"name = '{EXPERIMENT}'")
    rendered_text(chromium, ui_url(team.mlflow_url, f"#/models/{EXPERIMENT}"),
                  ["champion"] + [f"Version {v.version}" for v in versions])
    shots.append(screenshot(chromium, "mlflow-registered-model"))
    print("screenshots:", *shots, sep="\n  ")


def test_forced_stage_reruns_itself_and_downstream_only(micro_run):
    from flows.lifecycle import lifecycle

    forced = lifecycle(config=CONFIG, stages=["export", "evaluate", "serve"], force=["export"])
    rerun = {"export", "evaluate", "serve"}
    assert {s: v for s, v in _status(forced).items() if s in rerun} == {s: "ran" for s in rerun}
    assert {v for s, v in _status(forced).items() if s not in rerun} == {"cached"}  # the upstream they read
    assert forced["export"]["fingerprint"] == _first_fingerprints(micro_run)["export"]  # same inputs, same artifact


def test_killed_training_job_is_retried_from_its_checkpoint(micro_run):
    """Rank 0 is SIGKILLed after step 12 of the first launch; the task retries, the job resumes from
    the step-10 checkpoint and ends with exactly the weights of the uninterrupted pretrain run."""
    from flows.stages import STAGE_FLOWS

    first = _first_fingerprints(micro_run)
    kill = ["pretrain.faults.kill_rank=0", "pretrain.faults.kill_step=12"]
    ref = STAGE_FLOWS["pretrain"](config=CONFIG, overrides=FAST_RETRY + kill)
    assert not ref["cached"] and ref["fingerprint"] != first["pretrain"]
    ws = _ws()
    attempts = _attempts(ws, "pretrain", ref["fingerprint"])
    assert [(a["attempt"], a["status"]) for a in attempts] == [(0, "failed"), (1, "completed")]
    history = _stage_metrics(ws, ref["fingerprint"])
    assert [m.value for m in history["resumed_from_step"]] == [10.0]
    assert ref["summary"]["steps"] == 20
    clean, retried = _weights(ws, "pretrain", first["pretrain"]), _weights(ws, "pretrain", ref["fingerprint"])
    assert set(clean) == set(retried)
    assert all(torch.equal(clean[k], retried[k]) for k in clean)


def test_diverging_job_is_rolled_back_and_relaunched_at_a_lower_lr(micro_run):
    """A NaN at step 17 of the first launch with no in-job rollbacks allowed ends the job `diverged`;
    the task drops the step-15 checkpoint, relaunches from step 10 at half the LR, and completes."""
    from flows.stages import STAGE_FLOWS

    first = _first_fingerprints(micro_run)
    diverge = ["pretrain.checkpoint.every=5", "pretrain.faults.nan_step=17", "pretrain.spike.max_skips=1",
               "pretrain.spike.max_rollbacks=0", "pretrain.spike.task_lr_factor=0.5"]
    ref = STAGE_FLOWS["pretrain"](config=CONFIG, overrides=FAST_RETRY + diverge)
    ws = _ws()
    attempts = _attempts(ws, "pretrain", ref["fingerprint"])
    assert [(a["attempt"], a["status"]) for a in attempts] == [(0, "diverged"), (1, "completed")]
    assert attempts[0]["dropped_step"] == 15 and attempts[0]["resume_step"] == 10
    assert attempts[1]["lr_scale"] == 0.5
    history = _stage_metrics(ws, ref["fingerprint"])
    assert [m.value for m in history["resumed_from_step"]] == [10.0]
    clean_lr = {m.step: m.value for m in _stage_metrics(ws, first["pretrain"])["lr"]}
    lr = {m.step: m.value for m in history["lr"] if m.step > 10}
    assert lr and all(v == pytest.approx(0.5 * clean_lr[s]) for s, v in lr.items()), (lr, clean_lr)


def test_divergence_without_budget_fails_at_once(micro_run):
    """With spike.task_rollbacks=0 the first divergence ends the stage: not retried (a retry would
    pass, since the NaN fires on the first launch only), and the job's uncommitted output says why."""
    from flows.stages import STAGE_FLOWS
    from stages.attempts import DivergenceBudgetSpent

    diverge = ["pretrain.checkpoint.every=5", "pretrain.faults.nan_step=17", "pretrain.spike.max_skips=1",
               "pretrain.spike.max_rollbacks=0", "pretrain.spike.task_rollbacks=0"]
    with pytest.raises(DivergenceBudgetSpent, match="giving up"):
        STAGE_FLOWS["pretrain"](config=CONFIG, overrides=FAST_RETRY + diverge)
    ws = _ws()
    # the job's output in the store, never committed: no manifest beside its attempts.json
    uncommitted = [k for k in ws.store.list(f"{ws.experiment}/pretrain") if k.endswith("/attempts.json")
                   and not ws.store.exists(k.rsplit("/", 1)[0] + "/manifest.json")]
    assert [[a["status"] for a in ws.store.get_json(k)] for k in uncommitted] == [["diverged"]]


def test_ctrl_c_leaves_no_training_process_behind(micro_run):
    """`eightfold stage pretrain` interrupted while its torchrun job trains: the CLI exits 130 and
    every process it started (torchrun agent, ranks) is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    from prefect.settings import PREFECT_API_URL

    work = micro_run.work
    env = {**os.environ, "EIGHTFOLD_WORKDIR": str(work)}
    # the team's Prefect server: the CLI need not start a temporary one of its own
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    cmd = [sys.executable, "-m", "flows.cli", "stage", "pretrain", CONFIG, "--set", "pretrain.steps=100000",
           "--set", "infra.health_check=false"]
    # its own process group, like a shell's foreground job: Ctrl-C goes to the whole group
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    cli = psutil.Process(proc.pid)
    family: list[psutil.Process] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        family = cli.children(recursive=True)
        if any("trainer" in " ".join(p.cmdline()) for p in family if p.is_running()):
            break
        time.sleep(0.5)
    else:
        proc.kill()
        raise AssertionError(f"no trainer process appeared: {proc.stdout.read().decode()[-3000:]}")
    time.sleep(3)  # let it train a few steps
    family = cli.children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 130, out.decode()[-3000:]
    _, alive = psutil.wait_procs(family, timeout=15)
    assert not alive, [(p.pid, p.cmdline()) for p in alive if p.is_running()]
