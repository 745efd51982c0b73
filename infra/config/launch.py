"""`infra.slurm:` and `infra.kubernetes:` what the cluster launchers need beyond the job itself.

Nodes and processes per node come from `parallel:` (nnodes, nproc_per_node); these sections say
where and with what resources the job runs.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section

# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds (sbatch(1)); plus UNLIMITED/INFINITE.
_SLURM_TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$")
# Kubernetes quantities: a decimal number with an optional SI / binary suffix or exponent.
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")
# RFC 1123 labels: what Kubernetes accepts for namespaces and object names.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _node_names(nodes: list[str]) -> list[str]:
    for node in nodes:
        if not node or any(c.isspace() for c in node) or "," in node:
            raise ValueError(f"exclude entry {node!r} must be one node name (no spaces or commas)")
    return nodes


class SlurmConfig(Section):
    """An sbatch job: one task per node, each task a torchrun agent starting nproc_per_node ranks."""

    partition: str | None = Field(None, description="--partition; default: the cluster's default partition")
    account: str | None = Field(None, description="--account to charge")
    qos: str | None = Field(None, description="--qos")
    time_limit: str | None = Field(
        "24:00:00", description="--time (e.g. 90, 4:00:00, 2-00:00:00); None = the partition's limit"
    )
    gpus_per_node: int = Field(0, ge=0, description="--gpus-per-node; 0 = no GPU request (CPU job)")
    cpus_per_task: int | None = Field(None, ge=1, description="--cpus-per-task for each node's torchrun agent")
    mem: str | None = Field(None, description="--mem per node (e.g. 0 = all of it, 200G)")
    exclusive: bool = Field(False, description="--exclusive: nodes are not shared with other jobs")
    exclude: list[str] = Field(default_factory=list, description="nodes never to use (--exclude)")
    exclude_file: str | None = Field(
        None,
        description="file listing nodes that failed health checks, one per line; "
        "default {workdir}/slurm/exclude-nodes.txt, appended to by the health check",
    )
    rdzv_port: int | None = Field(
        None, ge=1024, le=65535,
        description="c10d rendezvous port on the first node; default 29500 + job id % 1000, "
        "so jobs sharing a node do not collide",
    )
    max_restarts: int = Field(0, ge=0, description="torchrun --max-restarts inside one allocation")
    node_health: bool = Field(
        True, description="probe every node of the allocation (srun step) before training; needs infra.health_check too"
    )
    node_health_timeout_s: int = Field(
        300, ge=10, description="a node whose probe has not reported by then is named bad (a hung device, a dead mount)"
    )
    setup: list[str] = Field(default_factory=list, description="shell lines run before srun (module load, source venv)")
    python: str | None = Field(None, description="Python on the nodes; default the interpreter that submits")
    extra_args: list[str] = Field(default_factory=list, description="more #SBATCH lines, e.g. --constraint=h100")
    poll_interval_s: float = Field(1.0, gt=0, description="seconds between scontrol polls while waiting")

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and v.upper() not in ("UNLIMITED", "INFINITE") and not _SLURM_TIME.match(v):
            raise ValueError(
                f"time_limit {v!r} is not a Slurm time: use minutes, HH:MM:SS or D-HH:MM:SS "
                "(e.g. 90, 4:00:00, 2-00:00:00)"
            )
        return v

    @field_validator("exclude")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        return _node_names(v)

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for arg in v:
            if not arg.startswith("-") or "\n" in arg:
                raise ValueError(f"extra_args entry {arg!r} must be one sbatch option such as --constraint=h100")
        return v


class KubernetesConfig(Section):
    """A JobSet (jobset.x-k8s.io/v1alpha2) or Kubeflow PyTorchJob (kubeflow.org/v1): one pod per node."""

    kind: Literal["jobset", "pytorchjob", "job"] = Field(
        "jobset",
        description="which controller runs the pods: JobSet, Kubeflow's PyTorchJob, or a plain Indexed batch/v1 Job "
        "with a headless Service (any cluster: no CRD or operator needed)",
    )
    namespace: str = Field("default", description="namespace of the job, its ConfigMap and service")
    image: str | None = Field(None, description="container image holding this project (required to render)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    gpus_per_pod: int = Field(0, ge=0, description="nvidia.com/gpu per pod (= per node); 0 = CPU pods")
    cpu: str = Field("4", description="CPU request per pod (Kubernetes quantity)")
    memory: str = Field("16Gi", description="memory request and limit per pod")
    shm_size: str | None = Field("8Gi", description="size of the in-memory /dev/shm volume; None = none")
    service_account: str | None = Field(None, description="serviceAccountName of the pods")
    env_from_secret: str | None = Field(
        None, description="Secret whose keys become env (e.g. AWS credentials for s3://)"
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    exclude: list[str] = Field(
        default_factory=list, description="nodes never to use (a required node affinity: metadata.name NotIn)"
    )
    exclude_file: str | None = Field(
        None,
        description="file listing nodes that failed health checks, one per line; "
        "default {workdir}/kubernetes/exclude-nodes.txt, appended to by the stage when a node's probe fails",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="pod tolerations, in Kubernetes' own shape"
    )
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="c10d rendezvous port on the first pod")
    max_restarts: int = Field(0, ge=0, description="torchrun --max-restarts inside a pod")
    backoff_limit: int = Field(0, ge=0, description="times the controller recreates failed pods (Prefect retries too)")
    ttl_seconds_after_finished: int | None = Field(86400, ge=0, description="delete the finished job after this")
    termination_grace_s: int | None = Field(
        None, ge=0, description="pods' terminationGracePeriodSeconds: SIGTERM to SIGKILL on cancel; None = 30"
    )
    poll_s: float = Field(5.0, gt=0, description="how often the launcher reads the job's status, pods and logs")
    workdir: str = Field("/workspace", description="job scratch folder inside the pod")
    kubeconfig: str | None = Field(
        None, description="kubeconfig path; default KUBECONFIG, ~/.kube/config, then the pod's service account"
    )
    context: str | None = Field(None, description="kubeconfig context; default the current one")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if len(v) > 63 or not _DNS_LABEL.match(v):
            raise ValueError(f"namespace {v!r} must be a DNS label: lower-case letters, digits and '-', at most 63")
        return v

    @field_validator("exclude")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        return _node_names(v)

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None and not _QUANTITY.match(str(v)):
            raise ValueError(f"{v!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
        return v

    @model_validator(mode="after")
    def _image(self) -> "KubernetesConfig":
        if self.image is not None and (not self.image.strip() or any(c.isspace() for c in self.image)):
            raise ValueError(f"image {self.image!r} must be an image reference without spaces")
        return self
