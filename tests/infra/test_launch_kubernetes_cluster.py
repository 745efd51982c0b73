"""The Kubernetes launcher end to end against the stand-in cluster (infra/k8s/README.md: no real
kube-apiserver installs on this machine), with `infra.launcher: kubernetes` and an s3:// store: the
pretrain stage runs the real trainer on two pods (JobSet) that rendezvous by their DNS names and
keep everything in S3; Ctrl-C in the stage's wait cancels a plain Indexed Job with nothing left
behind; a failing rank fails the job; pods no node can take stay Pending and say why."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
from kubernetes import client, config as kube_config

from infra.config import LifecycleConfig
from infra.launch import get_launcher
from infra.launch.job import JobResult, JobSpec
from infra.launch.kubernetes import object_name

ROOT = Path(__file__).resolve().parents[2]
WORKER = "fixtures.launch_worker"  # a stand-in for `-m trainer`: gloo all_reduce, sleep or fail
SECRET = "s3-credentials"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def core(k8s_cluster, s3_endpoint):
    """The CoreV1Api of the stand-in cluster, with the S3 credentials the pods take from a Secret."""
    api = client.CoreV1Api(kube_config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig)))
    creds = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    try:
        api.create_namespaced_secret("default", {"metadata": {"name": SECRET}, "stringData": creds})
    except client.exceptions.ApiException as exc:
        assert exc.status == 409, exc  # made by an earlier test of this session
    return api


def _k8s(cluster, kind: str = "jobset", **over) -> dict:
    """`infra.kubernetes` for the stand-in: small requests (one 2-core node), S3 keys from the Secret,
    a free rendezvous port, a short grace, a quick poll."""
    return {"kind": kind, "image": "eightfold:this-checkout", "kubeconfig": str(cluster.kubeconfig), "cpu": "100m",
            "memory": "2Gi", "shm_size": "256Mi", "env_from_secret": SECRET, "rdzv_port": _free_port(),
            "termination_grace_s": 2, "poll_s": 0.2, "ttl_seconds_after_finished": None, **over}  # fmt: skip


def _job(tmp_path: Path, cluster, s3_endpoint: str, bucket: str, kind: str, mode: str, **k8s):
    """The config (`infra.launcher: kubernetes`, an s3:// store) and job file of a 2-pod job."""
    cfg = LifecycleConfig.model_validate({
        "parallel": {"nnodes": 2, "nproc_per_node": 1, "dp": 2},
        "infra": {"launcher": "kubernetes", "store": f"s3://{bucket}/exp", "s3_endpoint_url": s3_endpoint,
                  "device": "cpu", "kubernetes": _k8s(cluster, kind, **k8s)},
    })  # fmt: skip
    job_id = f"pretrain-{kind}-{mode}-{os.urandom(3).hex()}"
    spec = JobSpec(
        job_id=job_id, stage="pretrain", config=cfg.model_dump(mode="json"),
        output=f"s3://{bucket}/exp/pretrain/{job_id}", workdir=str(tmp_path / "jobs" / job_id),
        # The "image" is this checkout: the worker module lives in tests/fixtures.
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "EIGHTFOLD_TEST_MODE": mode},
    )  # fmt: skip
    return cfg, spec


def _launch(tmp_path: Path, cluster, s3_endpoint: str, bucket: str, kind: str, mode: str, **k8s):
    cfg, spec = _job(tmp_path, cluster, s3_endpoint, bucket, kind, mode, **k8s)
    launcher = get_launcher(cfg, module=WORKER)
    assert launcher.name == "kubernetes"
    return launcher, spec, launcher.submit(spec, spec.write(Path(spec.workdir) / "job.yaml"))


def _processes_of(job_id: str) -> list[int]:
    """Pids on this machine whose environment carries the job's id (every rank and torchrun agent)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"EIGHTFOLD_JOB_ID={job_id}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_a_failing_rank_fails_the_job_and_names_its_exit_code(k8s_cluster, core, s3_endpoint, s3_store, tmp_path):
    launcher, spec, job = _launch(tmp_path, k8s_cluster, s3_endpoint, s3_store.bucket, "jobset", "fail")
    assert job.wait(timeout=120) == 1
    log = job.log_path.read_text()
    assert "Failed (exit code" in log, log
    assert launcher.result(spec) is None and not _processes_of(spec.job_id)


def test_a_node_failing_its_health_probe_is_named_and_no_rank_starts(k8s_cluster, core, s3_endpoint, s3_store,
                                                                      tmp_path):  # fmt: skip
    """Each pod's init container probes its node (infra/node_health.py) and reports to the output store;
    a failing node (injected) fails the init container, so the trainer never starts, the launcher names
    the init container, and the report names the node for the stage to exclude."""
    from infra.health import read_bad_nodes_from_store

    node = k8s_cluster.node.name
    cfg, spec = _job(tmp_path, k8s_cluster, s3_endpoint, s3_store.bucket, "jobset", "allreduce")
    spec = spec.model_copy(update={"env": {**spec.env, "EIGHTFOLD_FAULT_BAD_NODE": node}})
    job = get_launcher(cfg, module=WORKER).submit(spec, spec.write(Path(spec.workdir) / "job.yaml"))
    assert job.wait(timeout=120) != 0
    log = job.log_path.read_text()
    assert "init container node-health: exit code 75" in log, log
    assert "mode allreduce" not in log  # the worker never ran
    bad = read_bad_nodes_from_store(spec.output, s3_endpoint)
    assert list(bad) == [node] and "injected" in bad[node]


def test_the_retry_after_a_failed_probe_stays_off_that_node(s3_endpoint, s3_store, tmp_path):
    """Two nodes; the first fails its probe (injected) under both pods of a plain Indexed Job. The
    stage's own failure path (stages/pretrain.py) reads the bad node from the store and records it in
    the launcher's exclude file; the retry, a new launcher from the same config as Prefect's task
    retry makes, renders a required node affinity without that node, and its pods land on the other
    node and complete. The old code had nothing to exclude: the retry went back to the bad node."""
    from infra.k8s.cluster import StandinCluster
    from stages.pretrain import _bad_nodes, _exclude_bad_nodes

    with StandinCluster(tmp_path / "k8s", nodes=2) as cluster:
        bad_node, good_node = (n.name for n in cluster.nodes)
        api = client.CoreV1Api(kube_config.new_client_from_config(config_file=str(cluster.kubeconfig)))
        creds = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
        api.create_namespaced_secret("default", {"metadata": {"name": SECRET}, "stringData": creds})
        exclude_file = tmp_path / "work" / "kubernetes" / "exclude-nodes.txt"
        cfg, spec = _job(tmp_path, cluster, s3_endpoint, s3_store.bucket, "job", "allreduce",
                         exclude_file=str(exclude_file))  # fmt: skip
        spec = spec.model_copy(update={"env": {**spec.env, "EIGHTFOLD_FAULT_BAD_NODE": bad_node}})
        launcher = get_launcher(cfg, module=WORKER)
        job = launcher.submit(spec, spec.write(Path(spec.workdir) / "job.yaml"))
        assert job.wait(timeout=120) != 0
        assert "init container node-health: exit code 75" in job.log_path.read_text()
        assert {p.spec.node_name for p in job.pods()} == {bad_node}

        bad = _bad_nodes(spec)
        assert list(bad) == [bad_node]
        assert "excluded from later submits" in _exclude_bad_nodes(launcher, spec, bad)

        retry = spec.model_copy(update={"job_id": f"{spec.job_id}-r1", "attempt": 1,
                                        "workdir": str(Path(spec.workdir).with_name(f"{spec.job_id}-r1"))})  # fmt: skip
        launcher = get_launcher(cfg, module=WORKER)
        pod_spec = launcher.render(retry)[-1]["spec"]["template"]["spec"]
        term = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"] == [
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [bad_node]}]}
        ]
        job = launcher.submit(retry, retry.write(Path(retry.workdir) / "job.yaml"))
        assert job.wait(timeout=120) == 0, job.log_path.read_text()
        assert {p.spec.node_name for p in job.pods()} == {good_node}
        assert launcher.result(retry).status == "completed"


def test_pods_that_fit_no_node_stay_pending_and_say_why(k8s_cluster, core, s3_endpoint, s3_store, tmp_path):
    # The node has no GPU: the scheduler leaves the pods Pending, as a real one does.
    _, spec, job = _launch(tmp_path, k8s_cluster, s3_endpoint, s3_store.bucket, "jobset", "allreduce", gpus_per_pod=1)
    deadline = time.monotonic() + 30
    while job.poll() == "pending" and "Insufficient nvidia.com/gpu" not in job.log_path.read_text():
        assert time.monotonic() < deadline, job.log_path.read_text()
        time.sleep(0.2)
    assert job.poll() == "pending" and "0/1 nodes are available: Insufficient nvidia.com/gpu." in job.log_path.read_text()
    job.cancel(wait_s=10)
    assert job.pods() == [] and not _processes_of(spec.job_id)


def test_ctrl_c_in_the_stage_cancels_the_job_and_kills_every_rank(k8s_cluster, core, s3_endpoint, s3_store, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """The pretrain stage's own launch-and-wait, interrupted as by Ctrl-C once both pods run (a plain
    Indexed Job + headless Service; rank 1 ignores SIGTERM): the Job, its pods, Service and ConfigMap
    and every rank's process are gone before the interrupt reaches the caller. The KeyboardInterrupt
    is raised from the job's wait, where Ctrl-C finds the task, rather than by a simulated signal: what
    an earlier test left as SIGINT's handler cannot change the outcome (the CLI's real Ctrl-C is
    tests/flows/test_full_lifecycle.py's)."""
    from types import SimpleNamespace

    import stages.pretrain as pretrain
    from infra.launch.kubernetes import KubernetesJob

    cfg, spec = _job(tmp_path, k8s_cluster, s3_endpoint, s3_store.bucket, "job", "sleep")
    spec = spec.model_copy(update={"resume": "none"})  # a fresh job: no earlier attempts to learn from
    monkeypatch.setattr(pretrain, "get_launcher", lambda c: get_launcher(c, module=WORKER))
    name = object_name(spec.job_id)
    log = Path(spec.workdir) / "logs" / f"{spec.job_id}.log"
    interrupted = []

    def wait_then_ctrl_c(job, timeout=None, poll_s=None):
        deadline = time.monotonic() + 90
        # Two torchrun agents and their two ranks, and the first pod's output followed while it runs.
        while len(_processes_of(spec.job_id)) < 4 or not log.exists() or "mode sleep" not in log.read_text():
            assert job.poll() in ("pending", "running") and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert core.read_namespaced_service(name, "default").spec.cluster_ip == "None"
        interrupted.append(time.monotonic())
        raise KeyboardInterrupt

    monkeypatch.setattr(KubernetesJob, "wait", wait_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        pretrain.launch_and_wait(SimpleNamespace(cfg=cfg), spec)
    took = time.monotonic() - interrupted[0]
    print(f"cancel took {took:.1f} s")
    assert took < 15, took  # torchrun stops its ranks on SIGTERM; the node SIGKILLs whatever is left
    assert "mode sleep" in log.read_text() and "no pod left" in log.read_text()
    assert core.list_namespaced_pod("default", label_selector=f"batch.kubernetes.io/job-name={name}").items == []
    assert not _processes_of(spec.job_id)
    for read in (lambda: client.BatchV1Api(core.api_client).read_namespaced_job(name, "default"),
                 lambda: core.read_namespaced_config_map(f"{name}-job", "default"),
                 lambda: core.read_namespaced_service(name, "default")):  # fmt: skip
        with pytest.raises(client.exceptions.ApiException) as err:
            read()
        assert err.value.status == 404


@pytest.mark.slow
def test_pretrain_stage_runs_the_trainer_on_two_pods_with_everything_in_s3(k8s_cluster, core, s3_endpoint, s3_store,
                                                                           tmp_path):  # fmt: skip
    """The pretrain stage itself with `infra.launcher: kubernetes`: the real trainer, 2 pods x 1 rank
    (data parallel, ZeRO-1), reads the token shards from S3 into each pod's own cache, writes its
    checkpoint shards, metrics and result straight to the artifact's S3 prefix; the pods see none of
    this machine's /tmp, where the test's files and the stage's workspace are."""
    from fixtures.trainer_data import make_tokens, tiny_config
    from infra.store import open_store
    from infra.workspace import Workspace
    from stages import pretrain
    from stages.base import StageContext

    s3_store.put_dir(make_tokens(tmp_path / "tokens"), "tokens")
    data = tiny_config(steps=4, checkpoint={"every": 2}).model_dump(mode="json")
    data["parallel"].update(nnodes=2, nproc_per_node=1, dp=2, zero=1)
    data["infra"].update(
        workdir=str(tmp_path / "ws"), store=s3_store.url("runs"), s3_endpoint_url=s3_endpoint, launcher="kubernetes",
        device="cpu", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", kubernetes=_k8s(k8s_cluster),
    )  # fmt: skip
    cfg = LifecycleConfig.model_validate(data)
    out_uri = s3_store.url("runs/trainer-test/pretrain/k8s")
    (tmp_path / "out").mkdir()  # the task makes the artifact's local folder (the plot goes there)
    ctx = StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out", out_uri=out_uri,
                       input_uris={"tokens": s3_store.url("tokens")})  # fmt: skip
    summary = pretrain.run(ctx)
    assert summary["steps"] == 4 and 0 < summary["loss"] < 10
    assert (tmp_path / "out" / "activations.png").stat().st_size > 0  # from metrics.jsonl, read back from S3

    out = open_store(out_uri, endpoint_url=s3_endpoint)
    result = JobResult.model_validate_json(out.get_bytes("result.json"))
    assert result.status == "completed" and result.checkpoint.startswith(out_uri)
    keys = out.list("")
    assert any(k.startswith("metrics.jsonl") for k in keys)
    shards = [k for k in keys if k.startswith("checkpoints/") and k.endswith(".distcp")]
    assert {re.match(r"__(\d+)_", Path(k).name).group(1) for k in shards} == {"0", "1"}, shards  # from 2 pods

    # Followed on the way: both pods' phases, the first pod's own output, every pod's whole log kept.
    (log,) = (tmp_path / "ws").rglob("logs/pretrain-*.log")
    text, job_id = log.read_text(), log.stem
    name = object_name(job_id)
    for pod in (f"{name}-node-0-0-", f"{name}-node-0-1-"):
        assert f"[kubernetes] pod {pod}" in text
    assert text.count("Succeeded (exit code 0)") == 2 and any(not line.startswith("[kubernetes]") for line in text.splitlines())
    kept = sorted(p.stem.rsplit("-", 1)[0] for p in log.with_suffix("").iterdir())  # <pod>.log, pod = <job>-<5 chars>
    assert kept == [f"{name}-node-0-0", f"{name}-node-0-1"]
    # The JobSet owns its ConfigMap (deleting the JobSet takes it along); no rank outlived its pod.
    cm = core.read_namespaced_config_map(f"{name}-job", "default")
    assert [r.kind for r in cm.metadata.owner_references] == ["JobSet"]
    assert not _processes_of(job_id)


@pytest.mark.slow
def test_posttrain_sft_runs_in_a_pod_that_reads_its_inputs_from_s3(k8s_cluster, core, s3_endpoint, s3_store, tmp_path):
    """The post-train stage's SFT step with `infra.launcher: kubernetes` (one pod): the base weights,
    data, tokenizer and replay rows reach the pod as S3 URIs only; the tuned model comes back from S3."""
    from fixtures.posttrain import make_base, make_chat_tokenizer, posttrain_config
    from fixtures.posttrain import make_tokens as make_chat_tokens
    from infra.store import open_store
    from infra.workspace import Workspace
    from stages.base import StageContext
    from stages.posttrain.stage import run_step

    tok = make_chat_tokenizer(tmp_path / "tok")
    base_cfg = posttrain_config(sft={"steps": 2, "warmup_steps": 0, "num_examples": 16}, task={"heldout_size": 4})
    data = base_cfg.model_dump(mode="json")
    data["infra"].update(workdir=str(tmp_path / "ws"), store=s3_store.url("runs"), s3_endpoint_url=s3_endpoint,
                         launcher="kubernetes", kubernetes=_k8s(k8s_cluster))  # fmt: skip
    cfg = LifecycleConfig.model_validate(data)
    tokens = make_chat_tokens(tmp_path / "tokens", tok)
    s3_store.put_dir(tok, "tok")
    s3_store.put_dir(tokens, "tokens")
    out_uri = s3_store.url("runs/posttrain-test/posttrain-sft/k8s")
    ctx = StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out", out_uri=out_uri,
                       inputs={"pretrain": make_base(tmp_path / "pretrain", cfg, tok), "tokenizer": tok, "tokens": tokens},
                       input_uris={"tokenizer": s3_store.url("tok"), "tokens": s3_store.url("tokens")})  # fmt: skip
    summary = run_step(ctx, "sft")
    assert summary["steps"] == 2 and summary["heldout_n"] == 4
    out = open_store(out_uri, endpoint_url=s3_endpoint)
    assert JobResult.model_validate_json(out.get_bytes("result.json")).status == "completed"
    assert "model.safetensors" in out.list("") and "data/train.jsonl" in out.list("data")
    (pod,) = core.list_namespaced_pod("default", label_selector="eightfold/stage=posttrain-sft").items
    assert pod.status.phase == "Succeeded" and pod.status.container_statuses[0].state.terminated.exit_code == 0
