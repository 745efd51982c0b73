"""The Kubernetes launcher: JobSet and PyTorchJob manifests rendered from config, validated offline
against the Kubernetes schemas, and the client calls made against a stand-in API server."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from pydantic import ValidationError
from torch.distributed.run import get_args_parser

from infra.config import LifecycleConfig
from infra.config.launch import KubernetesConfig
from infra.launch.base import JobHandle, Launcher
from infra.launch.job import JobSpec
from infra.launch.kubernetes import (
    KubernetesLauncher,
    KubernetesUnavailable,
    ManifestError,
    manifest_problems,
    object_name,
    render,
    render_yaml,
    validate_manifest,
)

IMAGE = "ghcr.io/example/eightfold:0.1"


def _spec(nnodes: int = 2, nproc: int = 4, output: str = "s3://bucket/exp/pretrain/abc") -> JobSpec:
    cfg = LifecycleConfig.model_validate(
        {"parallel": {"nnodes": nnodes, "nproc_per_node": nproc, "dp": nnodes * nproc}, "pretrain": {"global_batch_size": 64}}
    )
    return JobSpec(
        job_id="pretrain-0f3a9c",
        stage="pretrain",
        config=cfg.model_dump(mode="json"),
        output=output,
        workdir="/home/me/.eightfold/jobs/pretrain-0f3a9c",
        env={"NCCL_DEBUG": "WARN"},
    )


def _pods(doc: dict) -> list[dict]:
    if doc["kind"] == "JobSet":
        return [r["template"]["spec"]["template"] for r in doc["spec"]["replicatedJobs"]]
    if doc["kind"] == "Job":
        return [doc["spec"]["template"]]
    return [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]


def _torchrun_args(container: dict):
    """The container's command parsed by torchrun's own argument parser."""
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    return get_args_parser().parse_args(cmd[3:])


@pytest.mark.parametrize("kind", ["jobset", "pytorchjob"])
def test_manifests_render_from_config_and_validate(kind):
    spec = _spec(nnodes=2, nproc=4)
    cfg = KubernetesConfig(kind=kind, image=IMAGE, gpus_per_pod=4, namespace="llm", service_account="trainer")
    config_map, job = render(spec, cfg)  # validates; raises on any problem
    assert manifest_problems(config_map) == [] and manifest_problems(job) == []
    name = object_name(spec.job_id)
    assert job["metadata"] == {**job["metadata"], "name": name, "namespace": "llm"}

    # The job file travels in the ConfigMap, pointing the pods at their own scratch folder.
    shipped = JobSpec.model_validate(yaml.safe_load(config_map["data"]["job.yaml"]))
    assert shipped.workdir == cfg.workdir
    assert shipped.model_dump(exclude={"workdir"}) == spec.model_dump(exclude={"workdir"})

    pods = _pods(job)
    total_pods = 0
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        args = _torchrun_args(container)
        assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "4", "c10d")
        assert args.module and args.training_script == "trainer"
        assert args.training_script_args == ["/etc/eightfold/job.yaml"]
        assert container["image"] == IMAGE and pod["spec"]["serviceAccountName"] == "trainer"
        res = container["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "4"
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
        # health per node first: an init container probing the node, reporting to the output store
        (init,) = pod["spec"]["initContainers"]
        assert init["command"] == ["python", "-m", "infra.node_health", "probe", "/etc/eightfold/job.yaml"]
        assert init["image"] == IMAGE and init["env"] == container["env"]
        assert {"name": "EIGHTFOLD_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in init["env"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts["/etc/eightfold"]]["configMap"]["name"] == config_map["metadata"]["name"]
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        host, port = args.rdzv_endpoint.rsplit(":", 1)
        if kind == "jobset":
            # Pod 0 of job 0 of the first replicated job, through the JobSet's headless service.
            rjob = job["spec"]["replicatedJobs"][0]
            assert job["spec"]["network"]["enableDNSHostnames"] is True
            assert host == f"{name}-{rjob['name']}-0-0.{name}" and int(port) == ports["c10d"]
            assert rjob["template"]["spec"]["completionMode"] == "Indexed"
            total_pods += rjob["replicas"] * rjob["template"]["spec"]["parallelism"]
        else:
            # MASTER_ADDR / MASTER_PORT come from the training operator; the port is the one it reads.
            assert args.rdzv_endpoint == "$(MASTER_ADDR):$(MASTER_PORT)" and "pytorchjob-port" in ports
            assert container["name"] == "pytorch"
    if kind == "pytorchjob":
        reps = job["spec"]["pytorchReplicaSpecs"]
        total_pods = sum(r["replicas"] for r in reps.values())
        assert reps["Master"]["replicas"] == 1 and job["spec"]["nprocPerNode"] == "4"
    assert total_pods == 2  # one pod per node

    # The YAML a user would `kubectl apply -f` parses back to the same objects.
    assert list(yaml.safe_load_all(render_yaml([config_map, job]))) == [config_map, job]


def _broken(kind: str, edit) -> dict:
    _, job = render(_spec(), KubernetesConfig(kind=kind, image=IMAGE, gpus_per_pod=2))
    job = copy.deepcopy(job)
    edit(_pods(job)[0]["spec"]["containers"][0], job)
    return job


@pytest.mark.parametrize("kind", ["jobset", "pytorchjob"])
@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c, j: c.pop("image"), r"containers\[0\]\.image: missing; every container needs an image"),
        (lambda c, j: c.update(image=""), r"containers\[0\]\.image: missing"),
        (lambda c, j: c["resources"]["limits"].update(memory="16 GB"), r"limits\.memory: '16 GB' is not a Kubernetes quantity"),
        (lambda c, j: c["resources"]["requests"].update({"nvidia.com/gpu": "1"}), r"nvidia.com/gpu requests \(1\) must equal limits \(2\)"),
        (lambda c, j: c["resources"]["limits"].update({"nvidia.com/gpu": "0.5"}), r"limits\.nvidia.com/gpu: must be a whole number"),
        (
            lambda c, j: (c["resources"]["limits"].update(cpu="8"), c["resources"]["requests"].update(cpu="64")),
            r"cpu request 64 exceeds its limit 8",
        ),
        (lambda c, j: c.update(imagee="x"), r"containers\[0\]\.imagee: unknown field"),
        (lambda c, j: c["ports"][0].update(containerPort="29500"), r"ports\[0\]\.containerPort: Input should be a valid integer"),
        (lambda c, j: c["volumeMounts"].append({"name": "data", "mountPath": "/data"}), r"volume 'data' is not declared"),
        (lambda c, j: j["metadata"].update(name="Pretrain_Job"), r"metadata\.name: 'Pretrain_Job' does not match"),
        (lambda c, j: j["spec"].update(replicas=3), r"spec: Additional properties are not allowed \('replicas'"),
    ],
)
def test_broken_manifest_fails_with_a_clear_message(kind, edit, expected):
    job = _broken(kind, edit)
    with pytest.raises(ManifestError, match=expected) as err:
        validate_manifest(job)
    assert str(err.value).startswith(f"{job['kind']}/{job['metadata']['name']}: ")


def test_kind_specific_rules():
    _, job = render(_spec(), KubernetesConfig(kind="pytorchjob", image=IMAGE))
    no_master = copy.deepcopy(job)
    no_master["spec"]["pytorchReplicaSpecs"]["Worker"] = no_master["spec"]["pytorchReplicaSpecs"].pop("Master")
    assert any("'Master' is a required property" in p for p in manifest_problems(no_master))
    renamed = copy.deepcopy(job)
    renamed["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "main"
    assert any("the operator runs the container named 'pytorch'" in p for p in manifest_problems(renamed))
    _, jobset = render(_spec(), KubernetesConfig(kind="jobset", image=IMAGE))
    always = copy.deepcopy(jobset)
    always["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    assert any("a Job's pods need Never or OnFailure" in p for p in manifest_problems(always))
    empty = copy.deepcopy(jobset)
    empty["spec"]["replicatedJobs"] = []
    assert any("replicatedJobs: [] should be non-empty" in p for p in manifest_problems(empty))


def test_config_errors_name_the_field():
    with pytest.raises(ManifestError, match="image: not set"):
        render(_spec(), KubernetesConfig(kind="jobset"))
    with pytest.raises(ValidationError, match="'16 GB' is not a Kubernetes quantity"):
        KubernetesConfig(image=IMAGE, memory="16 GB")
    with pytest.raises(ValidationError, match="namespace 'LLM' must be a DNS label"):
        KubernetesConfig(image=IMAGE, namespace="LLM")
    with pytest.raises(ValidationError, match="kind"):
        KubernetesConfig(image=IMAGE, kind="mpijob")


def test_long_job_ids_give_short_unique_dns_names():
    a, b = object_name("ablations/proxy-" + "x" * 80 + "-1"), object_name("ablations/proxy-" + "x" * 80 + "-2")
    assert a != b and len(a) <= 40 and len(b) <= 40
    for name in (a, b, object_name("Pretrain_Run.7")):
        assert validate_manifest({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}) is None


# --- submitting, against a stand-in API server ------------------------------------------------


class _FakeApi(BaseHTTPRequestHandler):
    """The few Kubernetes API paths the launcher calls, answering like the API server does."""

    objects: dict[str, dict] = {}
    calls: list[tuple[str, str]] = []

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path))
        self.objects[f"{self.path}/{body['metadata']['name']}"] = body
        self._reply(201, body)

    def do_GET(self):  # noqa: N802
        self.calls.append(("GET", self.path))
        if self.path in self.objects:
            self._reply(200, self.objects[self.path])
        elif self.path.split("?")[0].endswith("/pods"):  # the launcher follows the job's pods
            self._reply(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": []})
        else:
            self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})

    def do_PATCH(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("PATCH", self.path))
        self.objects[self.path] = {**self.objects.get(self.path, {}), **body}
        self._reply(200, self.objects[self.path])

    def do_DELETE(self):  # noqa: N802
        self.calls.append(("DELETE", self.path))
        self.objects.pop(self.path, None)
        self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_api(tmp_path):
    _FakeApi.objects, _FakeApi.calls = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
                "users": [{"name": "test", "user": {"token": "not-a-secret"}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            }
        )  # fmt: skip
    )
    yield kubeconfig
    server.shutdown()


def test_submit_creates_configmap_and_jobset_then_follows_and_cancels(fake_api, tmp_path):
    cfg = KubernetesConfig(kind="jobset", image=IMAGE, namespace="llm", kubeconfig=str(fake_api))
    spec = _spec().model_copy(update={"workdir": str(tmp_path)})  # the job's log file goes there
    launcher = KubernetesLauncher(cfg, env={"EIGHTFOLD_DEVICE": "cuda"})
    assert isinstance(launcher, Launcher)
    job = launcher.submit(spec)
    assert isinstance(job, JobHandle)
    name = object_name(spec.job_id)
    path = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/llm/jobsets/{name}"
    assert _FakeApi.calls[:2] == [
        ("POST", "/api/v1/namespaces/llm/configmaps"),
        ("POST", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/llm/jobsets"),
    ]
    created = _FakeApi.objects[path]
    # What was sent is exactly the validated manifest.
    assert created == render(spec, cfg, env={"EIGHTFOLD_DEVICE": "cuda"})[1]
    assert job.poll() == "pending"
    created["status"] = {"replicatedJobsStatus": [{"name": "node", "active": 1, "ready": 1}]}
    assert job.poll() == "running"
    created["status"]["conditions"] = [{"type": "Completed", "status": "True"}]
    assert job.poll() == "succeeded" and job.wait(timeout=1) == 0
    created["status"]["conditions"] = [{"type": "Failed", "status": "True"}]
    assert job.poll() == "failed" and job.wait(timeout=1) == 1
    job.cancel()
    assert ("DELETE", path) in _FakeApi.calls and path not in _FakeApi.objects
    assert ("DELETE", f"/api/v1/namespaces/llm/configmaps/{name}-job") in _FakeApi.calls
    assert job.poll() == "cancelled"


def test_submit_pytorchjob_paths_and_status(fake_api, tmp_path):
    cfg = KubernetesConfig(kind="pytorchjob", image=IMAGE, kubeconfig=str(fake_api))
    job = KubernetesLauncher(cfg).submit(_spec().model_copy(update={"workdir": str(tmp_path)}))
    path = f"/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/{object_name(_spec().job_id)}"
    assert ("POST", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs") in _FakeApi.calls
    obj = _FakeApi.objects[path]
    obj["status"] = {"conditions": [{"type": "Created", "status": "True"}]}
    assert job.poll() == "pending"
    obj["status"]["conditions"].append({"type": "Running", "status": "True"})
    assert job.poll() == "running"
    obj["status"]["conditions"] = [{"type": "Running", "status": "False"}, {"type": "Succeeded", "status": "True"}]
    assert job.poll() == "succeeded"


def test_submit_without_a_cluster_or_with_local_output_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    missing = tmp_path / "no-kubeconfig"
    launcher = KubernetesLauncher(KubernetesConfig(image=IMAGE, kubeconfig=str(missing)))
    with pytest.raises(KubernetesUnavailable, match="no Kubernetes cluster configured"):
        launcher.submit(_spec())
    with pytest.raises(ValueError, match="not reachable from pods; set infra.store to an s3:// bucket"):
        launcher.submit(_spec(output="file:///tmp/out"))


def test_plain_indexed_job_renders_with_a_headless_service_naming_its_pods():
    spec = _spec(nnodes=4, nproc=2)
    cfg = KubernetesConfig(kind="job", image=IMAGE, termination_grace_s=60)
    config_map, service, job = render(spec, cfg)  # validated against the client's V1Service and V1Job models
    name = object_name(spec.job_id)
    assert (config_map["kind"], service["kind"], job["kind"]) == ("ConfigMap", "Service", "Job")
    assert job["spec"] | {"template": None} == {"completionMode": "Indexed", "completions": 4, "parallelism": 4,
                                                "backoffLimit": 0, "ttlSecondsAfterFinished": 86400, "template": None}  # fmt: skip
    pod = job["spec"]["template"]["spec"]
    # Pod i is <job>-i (the Job controller's hostname) in the service's subdomain; pod 0 hosts the rendezvous.
    assert pod["subdomain"] == service["metadata"]["name"] == name and pod["terminationGracePeriodSeconds"] == 60
    assert _torchrun_args(pod["containers"][0]).rdzv_endpoint == f"{name}-0.{name}:{cfg.rdzv_port}"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    assert any("restartPolicy" in p for p in manifest_problems(bad))


def test_no_health_init_container_when_health_checks_are_off():
    spec = _spec()
    spec.config["infra"]["health_check"] = False
    _, job = render(spec, KubernetesConfig(image=IMAGE))
    assert all("initContainers" not in pod["spec"] for pod in _pods(job))


@pytest.mark.parametrize("kind", ["jobset", "pytorchjob", "job"])
def test_excluded_nodes_become_a_required_node_affinity_by_name(kind, tmp_path):
    """The config's `exclude` and the exclude file the stage appends to (infra/launch/exclude.py) both
    keep every pod off those nodes; the manifest still validates; without any, no affinity at all."""
    exclude_file = tmp_path / "exclude-nodes.txt"
    exclude_file.write_text("gpu-17  # pre-flight: matmul 40% slow\n")
    cfg = KubernetesConfig(kind=kind, image=IMAGE, exclude=["gpu-03", "gpu-17"], exclude_file=str(exclude_file))
    job = KubernetesLauncher(cfg).render(_spec())[-1]  # validated
    for pod in _pods(job):
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms == {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-03", "gpu-17"]}]}]}
    plain = render(_spec(), KubernetesConfig(kind=kind, image=IMAGE))[-1]
    assert all("affinity" not in pod["spec"] for pod in _pods(plain))
    with pytest.raises(ValidationError, match="must be one node name"):
        KubernetesConfig(image=IMAGE, exclude=["gpu 1"])
