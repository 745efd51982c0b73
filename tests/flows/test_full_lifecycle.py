"""The whole lifecycle on the micro config, through Prefect, once, as on a cluster whose nodes share
nothing but the object store: artifacts in S3 (a local S3 server), every training job on two nodes
(the local launcher's simulated nodes, each with a folder of its own), every file a rank writes
audited, and no path written by both nodes. Then on top of that run: a second run is all cache hits, a
forced stage re-runs only itself and what reads it, a training job killed mid-run is retried by the
task from its checkpoint in the store and ends with the same weights as the uninterrupted run, and a
diverging job is rolled back one checkpoint, relaunched at a lower LR and completes, or, with no
rollback budget, fails without burning its retries."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from fixtures.s3 import new_bucket_name, s3_endpoint  # noqa: F401
from infra.artifacts import find_artifact
from infra.config import load_config
from infra.workspace import Workspace
from stages.registry import STAGES

# the module's first test pays for the whole lifecycle (its fixture): a few minutes on 2 quiet cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# no retry delay; checkpoints saved synchronously, so the one before the fault is committed for sure
FAST_RETRY = ["infra.retry_delay_s=0", "pretrain.checkpoint.async_save=false"]
CONFIG: str = ""  # the micro config on S3 and two nodes, written by the fixture


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory, prefect_harness, s3_endpoint):
    global CONFIG
    from flows.lifecycle import lifecycle

    root = tmp_path_factory.mktemp("lifecycle")
    work, audit = root / "work", root / "audit"
    cfg = load_config("micro").model_dump(mode="json")
    cfg["infra"].update(store=f"s3://{new_bucket_name()}/artifacts", s3_endpoint_url=s3_endpoint)
    cfg["parallel"].update(nnodes=2, nproc_per_node=1, dp=2)
    # a training job that hangs is cancelled and retried within minutes, not at the test's timeout
    cfg["infra"]["task_timeout_s"] = {t: 300 for t in ("pretrain", "posttrain-sft", "posttrain-dpo", "posttrain-grpo")}
    CONFIG = str(root / "micro-s3-two-nodes.yaml")
    Path(CONFIG).write_text(yaml.safe_dump(cfg))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EIGHTFOLD_WORKDIR", str(work))
        mp.setenv("EIGHTFOLD_AUDIT_WRITES", str(audit))  # trainer/audit.py: every rank's writes
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("PREFECT_API_URL", raising=False)
        try:
            first = lifecycle(config=CONFIG)
        except BaseException:
            _print_job_logs(work)
            raise
        yield work, first, audit


def _print_job_logs(work: Path) -> None:
    """The last lines of every training job's log (each node's and the launcher's): what CI shows of a
    failed lifecycle."""
    for log in sorted(work.rglob("logs/*.log")):
        lines = log.read_text(errors="replace").splitlines()[-30:]
        print(f"--- {log.relative_to(work)} (last {len(lines)} lines) ---", *lines, sep="\n")


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


def test_no_path_is_written_by_both_nodes(micro_run):
    """Every training job (proxies aside: one node) ran on two node folders; the ranks' writes (files
    opened for writing, rename targets) name no path outside the store that both nodes wrote."""
    work, first, audit = micro_run
    by_node: dict[str, set[str]] = {}
    for f in audit.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            by_node.setdefault(Path(rec["node"]).name, set()).add(rec["path"])
    assert {"node0", "node1"} <= set(by_node), sorted(by_node)
    assert by_node["node0"] and by_node["node1"]
    assert not by_node["node0"] & by_node["node1"], sorted(by_node["node0"] & by_node["node1"])[:5]
    # the store is S3: nothing of the artifacts is on this machine's disk
    assert not (work / "artifacts").exists()


def test_every_stage_ran_and_second_run_is_all_cached(micro_run):
    from flows.lifecycle import lifecycle

    work, first, _ = micro_run
    assert _status(first) == {s: "ran" for s in STAGES}
    ws = _ws()
    folder = _folder(ws, "export", first["export"]["fingerprint"])
    # the export ships the last post-train model and, for the table, every earlier one
    summary = json.loads((folder / "export.json").read_text())
    assert summary["source"] == "posttrain-grpo" and set(summary["lineage"]) == {"pretrain", "sft", "dpo"}
    table = json.loads((_folder(ws, "evaluate", first["evaluate"]["fingerprint"]) / "evaluation.json").read_text())
    rows = [r["variant"] for r in table["rows"]]
    assert rows[:4] == ["pretrain", "sft", "dpo", "grpo"] and len(rows) > 4, rows

    second = lifecycle(config=CONFIG)
    assert _status(second) == {s: "cached" for s in STAGES}
    assert {s: r["fingerprint"] for s, r in second.items()} == {s: r["fingerprint"] for s, r in first.items()}


def test_forced_stage_reruns_itself_and_downstream_only(micro_run):
    from flows.lifecycle import lifecycle

    forced = lifecycle(config=CONFIG, stages=["export", "evaluate", "serve"], force=["export"])
    rerun = {"export", "evaluate", "serve"}
    assert {s: v for s, v in _status(forced).items() if s in rerun} == {s: "ran" for s in rerun}
    assert {v for s, v in _status(forced).items() if s not in rerun} == {"cached"}  # the upstream they read
    work, first, _ = micro_run
    assert forced["export"]["fingerprint"] == first["export"]["fingerprint"]  # same inputs, same artifact


def test_killed_training_job_is_retried_from_its_checkpoint(micro_run):
    """Rank 0 is SIGKILLed after step 12 of the first launch; the task retries, the job resumes from
    the step-10 checkpoint and ends with exactly the weights of the uninterrupted pretrain run."""
    from flows.stages import STAGE_FLOWS

    work, first, _ = micro_run
    kill = ["pretrain.faults.kill_rank=0", "pretrain.faults.kill_step=12"]
    ref = STAGE_FLOWS["pretrain"](config=CONFIG, overrides=FAST_RETRY + kill)
    assert not ref["cached"] and ref["fingerprint"] != first["pretrain"]["fingerprint"]
    ws = _ws()
    attempts = _attempts(ws, "pretrain", ref["fingerprint"])
    assert [(a["attempt"], a["status"]) for a in attempts] == [(0, "failed"), (1, "completed")]
    history = _stage_metrics(ws, ref["fingerprint"])
    assert [m.value for m in history["resumed_from_step"]] == [10.0]
    assert ref["summary"]["steps"] == 20
    clean, retried = _weights(ws, "pretrain", first["pretrain"]["fingerprint"]), _weights(ws, "pretrain", ref["fingerprint"])
    assert set(clean) == set(retried)
    assert all(torch.equal(clean[k], retried[k]) for k in clean)


def test_diverging_job_is_rolled_back_and_relaunched_at_a_lower_lr(micro_run):
    """A NaN at step 17 of the first launch with no in-job rollbacks allowed ends the job `diverged`;
    the task drops the step-15 checkpoint, relaunches from step 10 at half the LR, and completes."""
    from flows.stages import STAGE_FLOWS

    work, first, _ = micro_run
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
    clean_lr = {m.step: m.value for m in _stage_metrics(ws, first["pretrain"]["fingerprint"])["lr"]}
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

    work, _, _ = micro_run
    env = {**os.environ, "EIGHTFOLD_WORKDIR": str(work)}
    # the session's Prefect server (the harness's): the CLI need not start a temporary one of its own
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
