"""The Kubernetes launcher: a JobSet (jobset.x-k8s.io/v1alpha2), a Kubeflow PyTorchJob
(kubeflow.org/v1) or a plain Indexed batch/v1 Job with a headless Service, one pod per node, each pod
a torchrun agent, plus a ConfigMap holding the job file. Rendered from `infra/templates/` and
`infra.kubernetes:`, validated offline, and created with the kubernetes client when a cluster is
configured; then followed (the job's conditions, its pods' phases, the first pod's log into the job's
log file) and, on cancel, deleted with foreground propagation so no pod outlives it.

Offline validation is the Kubernetes schema as the client ships it: `kubernetes.client` models are
pydantic models generated from the API's OpenAPI spec (`extra="forbid"`, typed fields), so the Job
template, pod template and ConfigMap are checked field by field; the CRDs' own top level (not in
the client) is checked against a JSON schema written from their Go types; then the rules the API
server enforces beyond types: an image per container, parseable resource quantities, whole GPUs with
requests equal to limits, mounts naming declared volumes, a DNS-label name.

Outputs must be in object storage (`s3://`): a pod cannot write to this machine's disk.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

from infra.config.launch import KubernetesConfig
from infra.launch.base import follow_file, read_result
from infra.launch.exclude import excluded_nodes, read_exclude_file
from infra.launch.job import JobResult, JobSpec
from infra.templates import render_template

JOB_FILE_IN_POD = "/etc/eightfold/job.yaml"
EXCLUDE_FILE = Path("kubernetes") / "exclude-nodes.txt"  # under the infra workdir
KINDS = {
    # kind -> (template, group, version, plural, object kind)
    "jobset": ("jobset.yaml.j2", "jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet"),
    "pytorchjob": ("pytorchjob.yaml.j2", "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
    "job": ("indexedjob.yaml.j2", "batch", "v1", "jobs", "Job"),
}
# The label every pod of a job carries, by kind (set by the JobSet, training-operator and Job controllers).
POD_SELECTOR = {
    "JobSet": "jobset.sigs.k8s.io/jobset-name={name}",
    "PyTorchJob": "training.kubeflow.org/job-name={name}",
    "Job": "batch.kubernetes.io/job-name={name}",
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# JobSet pod hostnames are <name>-node-<job>-<pod>; keep them within a 63-character DNS label.
_MAX_NAME = 40
_CONFIGMAP_LIMIT = 1024 * 1024


class ManifestError(ValueError):
    """A manifest the API server would reject; `problems` lists `where: what` lines."""

    def __init__(self, what: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{what}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems))


class KubernetesUnavailable(RuntimeError):
    """No cluster to submit to (no kubeconfig, not in a pod) or the API refused the request."""


# --- rendering ------------------------------------------------------------------------------------


def object_name(job_id: str) -> str:
    """A DNS label from a job id, short enough for JobSet's pod hostnames; a hash keeps it unique."""
    base = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-") or "job"
    name = f"eightfold-{base}"
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
        name = f"{name[: _MAX_NAME - 9].rstrip('-')}-{digest}"
    return name


def _shape(spec: JobSpec, nnodes: int | None, nproc_per_node: int | None) -> tuple[int, int]:
    parallel = spec.config.get("parallel") or {}
    return nnodes or int(parallel.get("nnodes", 1)), nproc_per_node or int(parallel.get("nproc_per_node", 1))


def render(
    spec: JobSpec,
    config: KubernetesConfig,
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    module: str = "trainer",
    env: dict[str, str] | None = None,
    exclude: list[str] | None = None,
    validate: bool = True,
) -> list[dict[str, Any]]:
    """[ConfigMap with the job file, (headless Service, for kind job), the workload] for this job,
    validated unless told not to. `exclude`: nodes no pod may land on, besides the config's own list."""
    if config.image is None:
        raise ManifestError("infra.kubernetes", ["image: not set; the pods need the project's container image"])
    nnodes, nproc = _shape(spec, nnodes, nproc_per_node)
    template, _, _, _, _ = KINDS[config.kind]
    name = object_name(spec.job_id)
    config_map = f"{name}-job"
    labels = {"app.kubernetes.io/name": "eightfold", "eightfold/job-id": object_name(spec.job_id)[:63],
              "eightfold/stage": re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.stage)[:63].strip("-_.") or "stage"}  # fmt: skip

    subdomain = None
    if config.kind == "jobset":
        # Pod 0 of job 0 of replicated job "node", through the JobSet's headless service.
        endpoint = f"{name}-node-0-0.{name}:{config.rdzv_port}"
        port_name, restart_policy, container = "c10d", "Never", "trainer"
    elif config.kind == "job":
        # Pod 0 of the Indexed Job (hostname <job>-0), through our headless service named like the job.
        endpoint = f"{name}-0.{name}:{config.rdzv_port}"
        port_name, restart_policy, container, subdomain = "c10d", "Never", "trainer", name
    else:
        # Set by the training operator in every pod: the master's service and the port named below.
        endpoint = "$(MASTER_ADDR):$(MASTER_PORT)"
        port_name, restart_policy, container = "pytorchjob-port", "OnFailure", "pytorch"  # the operator's names

    command = [
        "python", "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={name}",
        f"--max-restarts={config.max_restarts}",
        "-m", module, JOB_FILE_IN_POD,
    ]  # fmt: skip
    env = {"PYTHONUNBUFFERED": "1", "EIGHTFOLD_JOB_ID": spec.job_id, **(env or {}), **spec.env}
    requests: dict[str, str] = {"cpu": str(config.cpu), "memory": str(config.memory)}
    limits: dict[str, str] = {"memory": str(config.memory)}
    if config.gpus_per_pod:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(config.gpus_per_pod)
    pod_values = {
        "labels": labels,
        "restart_policy": restart_policy,
        "service_account": config.service_account,
        "node_selector": config.node_selector,
        # By the Node object's name (what the probe reports as spec.nodeName), not a label that may differ.
        "exclude_nodes": excluded_nodes(config.exclude, exclude or []),
        "tolerations": config.tolerations,
        "container_name": container,
        "image": config.image,
        "image_pull_policy": config.image_pull_policy,
        "workdir": config.workdir,
        "command": command,
        # the node's name, for the health report (infra.health.node_name)
        "env": [{"name": k, "value": str(v)} for k, v in env.items()]
        + [{"name": "EIGHTFOLD_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "env_from_secret": config.env_from_secret,
        "port_name": port_name,
        "port": config.rdzv_port,
        "requests": requests,
        "limits": limits,
        "config_map": config_map,
        "shm_size": config.shm_size,
        "subdomain": subdomain,
        "termination_grace_s": config.termination_grace_s,
        "health_command": ["python", "-m", "infra.node_health", "probe", JOB_FILE_IN_POD]
        if (spec.config.get("infra") or {}).get("health_check", True) else None,
    }
    # The pods see their own scratch folder, not this machine's.
    in_pod = spec.model_copy(update={"workdir": config.workdir})
    job_yaml = yaml.safe_dump(in_pod.model_dump(mode="json"), sort_keys=False)
    common = {"name": name, "namespace": config.namespace, "labels": labels}
    docs = [yaml.safe_load(render_template("configmap.yaml.j2", config_map=config_map, job_yaml=job_yaml, **common))]
    if config.kind == "job":
        docs.append(yaml.safe_load(render_template("service.yaml.j2", port=config.rdzv_port, **common)))
    docs.append(
        yaml.safe_load(
            render_template(
                template,
                nnodes=nnodes,
                nproc_per_node=nproc,
                backoff_limit=config.backoff_limit,
                ttl_seconds_after_finished=config.ttl_seconds_after_finished,
                pod_values=pod_values,
                **common,
            )
        )
    )
    if validate:
        for doc in docs:
            validate_manifest(doc)
    return docs


def render_yaml(docs: list[dict[str, Any]]) -> str:
    """The manifests as one multi-document YAML file (what `kubectl apply -f` takes)."""
    return yaml.safe_dump_all(docs, sort_keys=False)


# --- offline validation ---------------------------------------------------------------------------

_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": _DNS_LABEL.pattern, "maxLength": 63},
        "namespace": {"type": "string", "pattern": _DNS_LABEL.pattern, "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
# Written from kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go (JobSetSpec, ReplicatedJob,
# Network, FailurePolicy, SuccessPolicy); `template` is a batch/v1 JobTemplateSpec, checked by the client model.
JOBSET_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "pattern": _DNS_LABEL.pattern},
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 1},
                            "template": {"type": "object"},
                            "dependsOn": {"type": "array", "maxItems": 5},
                        },
                    },
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string", "pattern": _DNS_LABEL.pattern},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
                },
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
                        "rules": {"type": "array"},
                    },
                },
                "successPolicy": {
                    "type": "object",
                    "required": ["operator"],
                    "properties": {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": {"type": "array"}},
                },
                "startupPolicy": {"type": "object"},
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object"},
                "managedBy": {"type": "string", "maxLength": 63},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "volumeClaimPolicies": {"type": "array", "maxItems": 50},
            },
        },
    },
}
_REPLICA_SPEC = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 1},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},
    },
}
# Written from kubeflow/training-operator pkg/apis/kubeflow.org/v1 (pytorch_types.go, common_types.go).
PYTORCHJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["pytorchReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"},
                        "managedBy": {"type": "string"},
                    },
                },
                "elasticPolicy": {"type": "object"},
                "nprocPerNode": {"type": "string", "pattern": r"^(auto|cpu|gpu|[1-9][0-9]*)$"},
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "required": ["Master"],
                    "additionalProperties": False,
                    "properties": {
                        "Master": {
                            **_REPLICA_SPEC,
                            "properties": {**_REPLICA_SPEC["properties"], "replicas": {"const": 1}},
                        },
                        "Worker": _REPLICA_SPEC,
                    },
                },
            },
        },
    },
}


def _where(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top)"


def _model_problems(model, data: Any, prefix: str) -> list[str]:
    """Validate `data` against a kubernetes.client model (pydantic, generated from the OpenAPI spec)."""
    import pydantic

    try:
        model.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = _where([prefix, *err["loc"]])
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{where}: {msg}")
        return problems
    return []


def _quantity_problems(where: str, resources: dict | None) -> list[str]:
    from kubernetes.utils.quantity import parse_quantity

    problems: list[str] = []
    parsed: dict[str, dict[str, Any]] = {}
    for kind in ("requests", "limits"):
        for res, value in ((resources or {}).get(kind) or {}).items():
            try:
                parsed.setdefault(kind, {})[res] = parse_quantity(value)
            except (ValueError, TypeError) as exc:
                problems.append(f"{where}.resources.{kind}.{res}: {value!r} is not a Kubernetes quantity ({exc})")
    requests, limits = parsed.get("requests", {}), parsed.get("limits", {})
    for res in set(requests) | set(limits):
        extended = "/" in res and not res.startswith("kubernetes.io/") and not res.startswith("hugepages-")
        if extended:
            # Extended resources (nvidia.com/gpu) are whole units, need a limit, and cannot be overcommitted.
            for kind, values in (("requests", requests), ("limits", limits)):
                if res in values and values[res] != int(values[res]):
                    problems.append(f"{where}.resources.{kind}.{res}: must be a whole number, got {values[res]}")
            if res not in limits:
                problems.append(f"{where}.resources.limits.{res}: an extended resource needs a limit")
            elif res in requests and requests[res] != limits[res]:
                problems.append(
                    f"{where}.resources: {res} requests ({requests[res]}) must equal limits ({limits[res]})"
                )
        elif res in requests and res in limits and requests[res] > limits[res]:
            problems.append(f"{where}.resources: {res} request {requests[res]} exceeds its limit {limits[res]}")
    return problems


def _pod_problems(pod_template: dict, where: str, job_pod: bool, container_name: str | None = None) -> list[str]:
    """What the API server checks in a pod template beyond field types."""
    spec = (pod_template or {}).get("spec") or {}
    problems: list[str] = []
    containers = spec.get("containers") or []
    if not containers:
        problems.append(f"{where}.spec.containers: a pod needs at least one container")
    if job_pod and spec.get("restartPolicy", "Always") not in ("Never", "OnFailure"):
        got = spec.get("restartPolicy", "Always")
        problems.append(f"{where}.spec.restartPolicy: a Job's pods need Never or OnFailure, got {got!r}")
    volumes = {v.get("name") for v in spec.get("volumes") or []}
    names = [c.get("name") for c in containers]
    if container_name and container_name not in names:
        problems.append(
            f"{where}.spec.containers: the operator runs the container named {container_name!r}, found {names}"
        )
    for i, c in enumerate(containers):
        cw = f"{where}.spec.containers[{i}]"
        if not isinstance(c.get("image"), str) or not c["image"].strip():
            problems.append(f"{cw}.image: missing; every container needs an image")
        if isinstance(c.get("name"), str) and not _DNS_LABEL.match(c["name"]):
            problems.append(f"{cw}.name: {c['name']!r} is not a DNS label")
        for j, e in enumerate(c.get("env") or []):
            if isinstance(e.get("name"), str) and not _ENV_NAME.match(e["name"]):
                problems.append(f"{cw}.env[{j}].name: {e['name']!r} is not a valid environment variable name")
        for j, m in enumerate(c.get("volumeMounts") or []):
            if m.get("name") not in volumes:
                problems.append(f"{cw}.volumeMounts[{j}]: volume {m.get('name')!r} is not declared in spec.volumes")
        problems += _quantity_problems(cw, c.get("resources"))
    return problems


def manifest_problems(doc: dict[str, Any]) -> list[str]:
    """Everything wrong with one manifest (ConfigMap, JobSet or PyTorchJob); empty when it is valid."""
    from kubernetes import client

    if not isinstance(doc, dict):
        return [f"a manifest must be a mapping, got {type(doc).__name__}"]
    kind = doc.get("kind")
    if kind == "ConfigMap":
        problems = _model_problems(client.V1ConfigMap, doc, "")
        size = sum(len(str(v).encode()) for v in (doc.get("data") or {}).values())
        if size > _CONFIGMAP_LIMIT:
            problems.append(f"data: {size} bytes exceeds the ConfigMap limit of {_CONFIGMAP_LIMIT}")
        if not _DNS_LABEL.match(str((doc.get("metadata") or {}).get("name", ""))):
            problems.append(f"metadata.name: {(doc.get('metadata') or {}).get('name')!r} is not a DNS name")
        return problems
    if kind == "Service":
        return _model_problems(client.V1Service, doc, "")
    if kind == "Job":
        problems = _model_problems(client.V1Job, doc, "")
        pod = ((doc.get("spec") or {}).get("template")) if isinstance(doc.get("spec"), dict) else None
        return problems + _pod_problems(pod or {}, "spec.template", job_pod=True)
    schemas = {"JobSet": JOBSET_SCHEMA, "PyTorchJob": PYTORCHJOB_SCHEMA}
    if kind not in schemas:
        return [f"kind: {kind!r} is not one this launcher renders (ConfigMap, Service, Job, JobSet, PyTorchJob)"]
    validator = jsonschema.Draft202012Validator(schemas[kind])
    problems = [f"{_where(e.absolute_path)}: {e.message}" for e in sorted(validator.iter_errors(doc), key=str)]
    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    if kind == "JobSet":
        for i, rjob in enumerate(spec.get("replicatedJobs") or []):
            if not isinstance(rjob, dict) or not isinstance(rjob.get("template"), dict):
                continue
            where = f"spec.replicatedJobs[{i}].template"
            problems += _model_problems(client.V1JobTemplateSpec, rjob["template"], where)
            pod = ((rjob["template"].get("spec") or {}).get("template")) or {}
            problems += _pod_problems(pod, f"{where}.spec.template", job_pod=True)
    else:
        for rtype, rspec in (spec.get("pytorchReplicaSpecs") or {}).items():
            if not isinstance(rspec, dict) or not isinstance(rspec.get("template"), dict):
                continue
            where = f"spec.pytorchReplicaSpecs.{rtype}.template"
            problems += _model_problems(client.V1PodTemplateSpec, rspec["template"], where)
            problems += _pod_problems(rspec["template"], where, job_pod=False, container_name="pytorch")
    return problems


def validate_manifest(doc: dict[str, Any]) -> None:
    """Raise ManifestError naming every problem of one manifest."""
    problems = manifest_problems(doc)
    if problems:
        meta = doc.get("metadata") if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict) else {}
        kind = doc.get("kind", "manifest") if isinstance(doc, dict) else "manifest"
        raise ManifestError(f"{kind}/{meta.get('name', '?')}", problems)


# --- submitting and following ---------------------------------------------------------------------


def api_client(config: KubernetesConfig):
    """A kubernetes ApiClient from the kubeconfig (config, KUBECONFIG, ~/.kube/config) or the pod's
    service account; KubernetesUnavailable when there is neither."""
    from kubernetes import config as kube_config

    try:
        return kube_config.new_client_from_config(config_file=config.kubeconfig, context=config.context)
    except Exception as kube_err:  # missing or unusable kubeconfig: try in-cluster
        try:
            kube_config.load_incluster_config()
        except Exception:
            raise KubernetesUnavailable(
                "no Kubernetes cluster configured: no usable kubeconfig "
                f"({config.kubeconfig or 'KUBECONFIG / ~/.kube/config'}: {kube_err}) and not running in a pod. "
                "Set infra.kubernetes.kubeconfig, or render the manifests with `eightfold deploy` "
                "and apply them yourself."
            ) from None
        from kubernetes import client

        return client.ApiClient()


def _not_found(exc: Exception) -> bool:
    return getattr(exc, "status", None) == 404


class KubernetesJob:
    """A submitted job, followed through its status conditions, its pods' phases and its first pod's log.

    Every `poll` also appends to `log_path` a `[kubernetes]` line per pod phase change (with the reason
    when a pod is stuck: Unschedulable, CreateContainerConfigError, a failed init container ...), and
    the first pod's output (node 0, the rendezvous host) streams in as it is written. When the job
    ends, every pod's whole log is kept beside it in `<log_path without .log>/<pod>.log`."""

    def __init__(self, job_id: str, name: str, config: KubernetesConfig, api, log_path: Path):
        self.job_id, self.name, self.config, self.api, self.log_path = job_id, name, config, api, log_path
        _, self.group, self.version, self.plural, self.kind = KINDS[config.kind]
        self._cancelled = False
        self.exit_code: int | None = None
        self._phases: dict[str, str] = {}
        self._log_offset: dict[str, int] = {}  # bytes of a pod's log already in log_path
        self._lock = threading.RLock()
        self._streamer: threading.Thread | None = None
        self._streamed_pod, self._stream_done = "", False

    def _get(self) -> dict:
        from kubernetes import client

        return client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            self.group, self.version, self.config.namespace, self.plural, self.name
        )

    def _state(self) -> str:
        status = self._get().get("status") or {}
        true = {c.get("type") for c in status.get("conditions") or [] if str(c.get("status")) == "True"}
        if "Failed" in true:
            return "failed"
        if true & {"Completed", "Succeeded", "Complete"}:
            return "succeeded"
        if self.kind == "PyTorchJob":
            return "running" if true & {"Running", "Restarting"} else "pending"
        if self.kind == "Job":
            return "running" if int(status.get("active") or 0) else "pending"
        active = sum(int(r.get("active", 0)) for r in status.get("replicatedJobsStatus") or [])
        return "running" if active else "pending"

    def poll(self) -> str:
        if self._cancelled:
            return "cancelled"
        state = self._state()
        try:
            self._follow(final=state not in ("pending", "running"))
        except Exception as exc:  # following is best effort: a log the API cannot serve must not fail the job
            self._append(f"[kubernetes] could not follow the pods: {exc}\n")
        return state

    def wait(self, timeout: float | None = None, poll_s: float | None = None) -> int:
        poll_s = self.config.poll_s if poll_s is None else poll_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.poll()) in ("pending", "running"):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.kind} {self.config.namespace}/{self.name} still {state} after {timeout} s")
            time.sleep(poll_s)
        self.exit_code = {"succeeded": 0, "cancelled": 143}.get(state, 1)
        return self.exit_code

    # --- following the pods -----------------------------------------------------------------------

    def pods(self) -> list:
        """The job's pods, sorted by name: the first is node 0's (JobSet and Job index 0, PyTorchJob's master)."""
        from kubernetes import client

        selector = POD_SELECTOR[self.kind].format(name=self.name)
        pods = client.CoreV1Api(self.api).list_namespaced_pod(self.config.namespace, label_selector=selector).items
        return sorted(pods, key=lambda p: p.metadata.name)

    def _append(self, text: str) -> None:
        with self._lock:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(text)

    @staticmethod
    def _phase(pod) -> str:
        """The phase, with why a pod is not running yet (what `kubectl get pods` shows as STATUS)."""
        phase = pod.status.phase or "Unknown"
        if pod.metadata.deletion_timestamp:
            return "Terminating"
        for cond in pod.status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False":
                return f"{phase} ({cond.reason}: {cond.message})"
        for cs in pod.status.init_container_statuses or []:  # a failed pre-flight (init container) says so
            terminated = cs.state.terminated if cs.state else None
            if terminated is not None and terminated.exit_code:
                return f"{phase} (init container {cs.name}: exit code {terminated.exit_code})"
        for cs in pod.status.container_statuses or []:
            waiting = cs.state.waiting if cs.state else None
            if waiting and waiting.reason:
                return f"{phase} ({waiting.reason}: {waiting.message or ''})"
            terminated = cs.state.terminated if cs.state else None
            if terminated is not None:
                return f"{phase} (exit code {terminated.exit_code})"
        return phase

    def _follow(self, final: bool = False) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self.api)
        with self._lock:
            pods = self.pods()
            for pod in pods:
                phase = self._phase(pod)
                if self._phases.get(pod.metadata.name) != phase:
                    self._phases[pod.metadata.name] = phase
                    self._append(f"[kubernetes] pod {pod.metadata.name}: {phase}\n")
            if pods and pods[0].status.phase in ("Running", "Succeeded", "Failed"):
                self._stream_first_pod(pods[0].metadata.name)
        if not final:
            return
        if self._streamer is not None:
            self._streamer.join(timeout=10)  # the stream ends with the container: take its last lines
        for pod in pods:  # every pod's whole log, kept beside the job's
            try:
                text = core.read_namespaced_pod_log(pod.metadata.name, self.config.namespace)
            except ApiException as exc:
                if exc.status in (400, 404):  # never started, or already gone
                    continue
                raise
            keep = self.log_path.with_suffix("") / f"{pod.metadata.name}.log"
            keep.parent.mkdir(parents=True, exist_ok=True)
            keep.write_text(text)

    def _stream_first_pod(self, pod: str) -> None:
        """Follow the first pod's log (one `follow=true` stream, not a re-read per poll) into the job's
        log, in a thread; started again, past what was written, if the stream broke while the pod runs."""
        if self._streamer is not None and self._streamer.is_alive():
            return
        if self._streamer is not None and self._streamed_pod == pod and self._stream_done:
            return  # this pod's container ended and its stream was read to the end
        self._streamed_pod, self._stream_done = pod, False
        self._streamer = threading.Thread(target=self._stream, args=(pod,), name=f"logs-{pod}", daemon=True)
        self._streamer.start()

    def _stream(self, pod: str) -> None:
        from kubernetes import client

        skip, pending = self._log_offset.get(pod, 0), b""
        try:
            resp = client.CoreV1Api(self.api).read_namespaced_pod_log(
                pod, self.config.namespace, follow=True, _preload_content=False
            )
            for chunk in resp.stream(65536):
                if skip:  # a resumed stream starts from the beginning again
                    chunk, skip = chunk[skip:], max(0, skip - len(chunk))
                pending += chunk
                lines, _, pending = pending.rpartition(b"\n")
                if lines:  # whole lines only, so the [kubernetes] lines never split one
                    self._append_bytes(pod, lines + b"\n")
            if pending:
                self._append_bytes(pod, pending)
            self._stream_done = True
        except Exception as exc:  # the next poll starts a new stream past what was written
            self._append(f"[kubernetes] log stream of {pod} broke: {exc}\n")

    def _append_bytes(self, pod: str, data: bytes) -> None:
        with self._lock:
            self._append(data.decode(errors="replace"))
            self._log_offset[pod] = self._log_offset.get(pod, 0) + len(data)

    def cancel(self, wait_s: float | None = None) -> None:
        """Delete the job object with foreground propagation (its Jobs and pods go first), its ConfigMap
        and Service; then wait until its pods are gone, at most the pods' grace period plus 15 s
        (`wait_s`), so that no rank outlives the task that cancelled it."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        ns, core = self.config.namespace, client.CoreV1Api(self.api)
        body = client.V1DeleteOptions(propagation_policy="Foreground")
        deletes = [
            lambda: client.CustomObjectsApi(self.api).delete_namespaced_custom_object(
                self.group, self.version, ns, self.plural, self.name, body=body
            ),
            lambda: core.delete_namespaced_config_map(f"{self.name}-job", ns),
        ]
        if self.kind == "Job":
            deletes.append(lambda: core.delete_namespaced_service(self.name, ns))
        for delete in deletes:
            try:
                delete()
            except ApiException as exc:
                if not _not_found(exc):  # already gone is what we want
                    raise
        self._cancelled = True
        grace = 30 if self.config.termination_grace_s is None else self.config.termination_grace_s
        deadline = time.monotonic() + (grace + 15 if wait_s is None else wait_s)
        while (left := self._left()) and time.monotonic() < deadline:
            time.sleep(min(self.config.poll_s, 0.5))
        self._append(f"[kubernetes] cancelled: {self.kind} {ns}/{self.name} deleted"
                     + (f"; still terminating: {', '.join(left)}\n" if left else "; no pod left\n"))  # fmt: skip

    def _left(self) -> list[str]:
        """What of the job still exists: its pods, then the job object (kept by foreground deletion
        until its pods are gone)."""
        from kubernetes.client.exceptions import ApiException

        left = [p.metadata.name for p in self.pods()]
        try:
            self._get()
            left.append(f"{self.kind} {self.name}")
        except ApiException as exc:
            if not _not_found(exc):
                raise
        return left

    def logs(self, follow: bool = False) -> Iterator[str]:
        """The first pod's output (node 0, the rendezvous host); with follow, the job's log file as it grows."""
        if follow:
            yield from follow_file(self.log_path, stop=lambda: self.poll() not in ("pending", "running"))
            return
        from kubernetes import client

        pods = self.pods()
        if not pods:
            return
        text = client.CoreV1Api(self.api).read_namespaced_pod_log(pods[0].metadata.name, self.config.namespace)
        yield from text.splitlines(keepends=True)


class KubernetesLauncher:
    """Render, validate and create the job's manifests; `module` replaces the trainer."""

    name = "kubernetes"

    def __init__(
        self,
        config: KubernetesConfig | None = None,
        *,
        nnodes: int | None = None,
        nproc_per_node: int | None = None,
        module: str = "trainer",
        env: dict[str, str] | None = None,
        exclude_file: str | Path | None = None,
    ):
        self.config = config or KubernetesConfig()
        self.nnodes, self.nproc_per_node, self.module = nnodes, nproc_per_node, module
        self.env = dict(env or {})
        self.exclude_file = Path(exclude_file) if exclude_file else (
            Path(self.config.exclude_file) if self.config.exclude_file else None
        )

    @classmethod
    def from_config(cls, cfg, workdir: str | Path, **kwargs) -> "KubernetesLauncher":
        """From a LifecycleConfig: `infra.kubernetes`, with the exclude file defaulting to the workdir's
        (on the machine that submits, like Slurm's: the stage records bad nodes there before its retry)."""
        k8s = cfg.infra.kubernetes
        exclude_file = Path(k8s.exclude_file) if k8s.exclude_file else Path(workdir) / EXCLUDE_FILE
        return cls(k8s, exclude_file=exclude_file, **kwargs)

    def render(self, spec: JobSpec) -> list[dict[str, Any]]:
        return render(
            spec, self.config, nnodes=self.nnodes, nproc_per_node=self.nproc_per_node, module=self.module, env=self.env,
            exclude=read_exclude_file(self.exclude_file),
        )

    def submit(self, spec: JobSpec, job_file: Path | None = None) -> KubernetesJob:
        if not spec.output.startswith("s3://"):
            raise ValueError(
                f"job {spec.job_id}: output {spec.output!r} is not reachable from pods; "
                "set infra.store to an s3:// bucket for the kubernetes launcher"
            )
        docs = self.render(spec)
        config_map, extras, job = docs[0], docs[1:-1], docs[-1]
        api = api_client(self.config)
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        _, group, version, plural, kind = KINDS[self.config.kind]
        ns, core = self.config.namespace, client.CoreV1Api(api)
        try:
            core.create_namespaced_config_map(ns, config_map)
            for extra in extras:  # the headless Service of a plain Job
                core.create_namespaced_service(ns, extra)
            created = client.CustomObjectsApi(api).create_namespaced_custom_object(group, version, ns, plural, job)
        except ApiException as exc:
            hint = f" (is the {kind} CRD installed?)" if exc.status == 404 and group not in ("", "batch") else ""
            raise KubernetesUnavailable(
                f"creating {kind} {ns}/{job['metadata']['name']} failed: {exc.status} {exc.reason}{hint}"
            ) from None
        self._adopt(core, [config_map, *extras], created)
        log_path = Path(spec.workdir).expanduser().resolve() / "logs" / f"{spec.job_id}.log"
        handle = KubernetesJob(spec.job_id, job["metadata"]["name"], self.config, api, log_path)
        handle._append(f"[kubernetes] created {kind} {ns}/{job['metadata']['name']} at {api.configuration.host}\n")
        return handle

    def _adopt(self, core, docs: list[dict], owner: dict) -> None:
        """Make the job own its ConfigMap and Service, so the garbage collector removes them with it
        (TTL after finishing, a delete by hand). Best effort: cancel deletes them by name anyway."""
        uid = (owner.get("metadata") or {}).get("uid")
        if not uid:
            return
        ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"], "uid": uid}
        patch = {"metadata": {"ownerReferences": [ref]}}
        for doc in docs:
            try:
                if doc["kind"] == "ConfigMap":
                    core.patch_namespaced_config_map(doc["metadata"]["name"], self.config.namespace, patch)
                else:
                    core.patch_namespaced_service(doc["metadata"]["name"], self.config.namespace, patch)
            except Exception:  # a cluster refusing the patch still runs the job
                pass

    def result(self, spec: JobSpec) -> JobResult | None:
        return read_result(spec)
