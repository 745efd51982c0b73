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


def test_secret_string_data_env_and_volumes_reach_the_process(api):
    core = client.CoreV1Api(api)
    core.create_namespaced_secret("default", {"metadata": {"name": "tok"}, "stringData": {"TOKEN": "s3cret"}})
    assert base64.b64decode(core.read_namespaced_secret("tok", "default").data["TOKEN"]) == b"s3cret"
    core.create_namespaced_config_map("default", {"metadata": {"name": "files"}, "data": {"a.txt": "from-cm"}})
    # $(ME) is Kubernetes' own expansion in command and args, done before the shell sees it.
    pod = _pod("env-and-volumes", ["sh", "-c", "echo $TOKEN $(ME) $POD_NAME $HOSTNAME; cat /etc/standin-test/a.txt; echo; "
                                  "touch /etc/standin-test/x 2>/dev/null || echo read-only"],  # fmt: skip
               volumes=[{"name": "cm", "configMap": {"name": "files"}}])
    c = pod["spec"]["containers"][0]
    c["envFrom"] = [{"secretRef": {"name": "tok"}}]
    c["env"] = [{"name": "ME", "value": "me"}, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    c["volumeMounts"] = [{"name": "cm", "mountPath": "/etc/standin-test", "readOnly": True}]
    core.create_namespaced_pod("default", pod)
    _until(lambda: core.read_namespaced_pod("env-and-volumes", "default").status.phase == "Succeeded", what="the pod")
    assert core.read_namespaced_pod_log("env-and-volumes", "default").split("\n")[:3] == [
        "s3cret me env-and-volumes env-and-volumes", "from-cm", "read-only"]
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
