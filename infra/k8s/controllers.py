"""The controllers our jobs need, each one reconcile pass over what the API lists:
- scheduler: binds each pending pod to a node whose labels match its nodeSelector, that its required
  node affinity admits (matchExpressions on labels, matchFields on metadata.name), and whose
  allocatable cpu, memory and nvidia.com/gpu still fit its requests (else PodScheduled=False, Unschedulable);
- Job controller (batch/v1): one pod per missing completion, Indexed mode's hostnames and
  JOB_COMPLETION_INDEX, backoffLimit, the FailureTarget/Failed and SuccessCriteriaMet/Complete conditions;
- JobSet controller (jobset.x-k8s.io/v1alpha2): a headless Service and one Indexed Job per replica of
  each replicated job, named <jobset>-<rjob>-<i>; failurePolicy.maxRestarts recreates them all;
  Completed or Failed conditions and replicatedJobsStatus;
- garbage collector: deletes dependents whose owner is gone, and finishes foreground deletions;
- TTL-after-finished for Jobs and JobSets.
No PyTorchJob controller: the training operator is not emulated (README.md says why)."""

from __future__ import annotations

import copy
import logging
import threading
from datetime import datetime, timezone

from infra.k8s.objects import now_iso
from infra.k8s.rest import Rest, RestError, object_path

log = logging.getLogger(__name__)
JOBSET = "jobset.x-k8s.io/v1alpha2"
JS_NAME, JS_RJOB, JS_INDEX, JS_ATTEMPT = (f"jobset.sigs.k8s.io/{k}" for k in
                                          ("jobset-name", "replicatedjob-name", "job-index", "restart-attempt"))  # fmt: skip
INDEX = "batch.kubernetes.io/job-completion-index"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
_TERMINAL = ("Succeeded", "Failed")


def _true(obj: dict) -> set[str]:
    return {c["type"] for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}


def _condition(kind: str, reason: str, message: str = "") -> dict:
    return {"type": kind, "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": now_iso(), "lastProbeTime": now_iso()}  # fmt: skip


def _owner(obj: dict) -> dict:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def _age_s(stamp: str | None) -> float:
    if not stamp:
        return 0.0
    then = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - then).total_seconds()


def _expire(api: Rest, obj: dict, plural: str) -> None:
    """TTL-after-finished: delete a finished object (and, in the background, what it owns)."""
    ttl = (obj.get("spec") or {}).get("ttlSecondsAfterFinished")
    finished = [c.get("lastTransitionTime") for c in (obj.get("status") or {}).get("conditions") or []
                if c.get("type") in ("Complete", "Failed", "Completed") and c.get("status") == "True"]  # fmt: skip
    if ttl is not None and finished and _age_s(finished[0]) >= ttl:
        api.delete(obj["apiVersion"], plural, obj["metadata"]["namespace"], obj["metadata"]["name"], "Background")


# --- scheduler ------------------------------------------------------------------------------------


def _requests(pod: dict) -> dict[str, object]:
    from kubernetes.utils.quantity import parse_quantity

    total: dict[str, object] = {}
    for c in pod["spec"].get("containers") or []:
        for res, value in ((c.get("resources") or {}).get("requests") or {}).items():
            total[res] = total.get(res, 0) + parse_quantity(value)
    return total


def _term_matches(term: dict, node: dict) -> bool:
    """One nodeSelectorTerm: every matchExpression (on labels) and matchField (metadata.name) holds."""
    labels, name = node["metadata"].get("labels") or {}, node["metadata"]["name"]
    checks = [(labels.get(e["key"]), e) for e in term.get("matchExpressions") or []]
    checks += [(name if f["key"] == "metadata.name" else None, f) for f in term.get("matchFields") or []]
    for value, req in checks:
        op, values = req["operator"], req.get("values") or []
        ok = {"In": value is not None and value in values, "NotIn": value is None or value not in values,
              "Exists": value is not None, "DoesNotExist": value is None}.get(op)  # fmt: skip
        if ok is None:
            raise ValueError(f"node affinity operator {op!r} is not supported by the stand-in scheduler")
        if not ok:
            return False
    return True


def _node_admits(pod: dict, node: dict) -> bool:
    """The pod's nodeSelector and its requiredDuringSchedulingIgnoredDuringExecution node affinity
    (terms ORed, as kube-scheduler does) both admit the node."""
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod["spec"].get("nodeSelector") or {}).items()):
        return False
    required = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})  # fmt: skip
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(_term_matches(t, node) for t in terms)


def schedule(api: Rest) -> None:
    from kubernetes.utils.quantity import parse_quantity

    nodes = [n for n in api.list("v1", "nodes") if "Ready" in _true(n)]
    pods = api.list("v1", "pods")
    used = {n["metadata"]["name"]: {} for n in nodes}
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if node in used and pod["status"].get("phase") not in _TERMINAL:
            for res, q in _requests(pod).items():
                used[node][res] = used[node].get(res, 0) + q
    for pod in pods:
        if pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
            continue
        want, why = _requests(pod), []
        for node in nodes:
            name = node["metadata"]["name"]
            if not _node_admits(pod, node):
                why.append("node(s) didn't match Pod's node affinity/selector")
                continue
            free = {r: parse_quantity(v) - used[name].get(r, 0) for r, v in node["status"].get("allocatable", {}).items()}
            short = [r for r, q in want.items() if q > free.get(r, 0)]
            if short:
                why.append(f"Insufficient {short[0]}")
                continue
            api.call("POST", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}/binding",
                     {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod["metadata"]["name"]},
                      "target": {"apiVersion": "v1", "kind": "Node", "name": name}})  # fmt: skip
            for res, q in want.items():
                used[name][res] = used[name].get(res, 0) + q
            break
        else:
            message = f"0/{len(nodes)} nodes are available: " + ", ".join(sorted(set(why)) or ["no nodes"]) + "."
            cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
            if (pod["status"].get("conditions") or [None])[0] != cond:
                api.patch("v1", "pods", pod["metadata"]["namespace"], pod["metadata"]["name"],
                          {"status": {"conditions": [cond]}}, status=True)  # fmt: skip


# --- Job controller -------------------------------------------------------------------------------


def _job_pod(job: dict, index: int | None) -> dict:
    meta, template = job["metadata"], copy.deepcopy(job["spec"]["template"])
    pod_meta = template.get("metadata") or {}
    spec = template["spec"]
    labels, annotations = dict(pod_meta.get("labels") or {}), dict(pod_meta.get("annotations") or {})
    prefix = meta["name"] + "-"
    if index is not None:
        labels[INDEX] = annotations[INDEX] = str(index)
        prefix += f"{index}-"
        spec["hostname"] = f"{meta['name']}-{index}"  # Indexed Jobs give every pod a stable hostname
        for c in spec.get("containers") or []:
            c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}}})  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod", "spec": spec,
            "metadata": {"generateName": prefix, "namespace": meta["namespace"], "labels": labels,
                         "annotations": annotations, "ownerReferences": [_owner(job)]}}  # fmt: skip


class JobController:
    def __init__(self) -> None:
        self._failed: dict[str, set[str]] = {}  # job uid -> failed pod uids (the real one tracks with finalizers)

    def sync(self, api: Rest) -> None:
        for job in api.list("batch/v1", "jobs"):
            meta, spec = job["metadata"], job["spec"]
            done = _true(job) & {"Complete", "Failed"}
            if done:
                _expire(api, job, "jobs")
            if meta.get("deletionTimestamp") or done or spec.get("suspend"):
                continue
            self._sync_one(api, job)

    def _sync_one(self, api: Rest, job: dict) -> None:
        meta, spec, status = job["metadata"], job["spec"], dict(job.get("status") or {})
        ns, uid = meta["namespace"], meta["uid"]
        pods = api.list("v1", "pods", ns, labels=f"{CONTROLLER_UID}={uid}")
        indexed = spec.get("completionMode") == "Indexed"
        failed = self._failed.setdefault(uid, set())
        succeeded, active, active_index = set(), [], set()
        for pod in pods:
            phase = pod["status"].get("phase")
            index = int(pod["metadata"].get("annotations", {}).get(INDEX, -1)) if indexed else pod["metadata"]["uid"]
            if phase == "Succeeded":
                succeeded.add(index)
            elif phase == "Failed":
                failed.add(pod["metadata"]["uid"])
            elif not pod["metadata"].get("deletionTimestamp"):
                active.append(pod)
                active_index.add(index)
        conditions = list(status.get("conditions") or [])
        kinds = {c["type"] for c in conditions}
        status.update(active=len(active), succeeded=len(succeeded), failed=len(failed),
                      ready=sum(1 for p in active if p["status"].get("phase") == "Running"))  # fmt: skip
        status.setdefault("startTime", now_iso())
        if indexed:
            status["completedIndexes"] = ",".join(str(i) for i in sorted(succeeded))
        completions, parallelism = int(spec.get("completions") or 1), int(spec.get("parallelism") or 1)
        if len(failed) > int(spec.get("backoffLimit", 6)) or "FailureTarget" in kinds:
            if "FailureTarget" not in kinds:
                conditions.append(_condition("FailureTarget", "BackoffLimitExceeded", "Job has reached the specified backoff limit"))
            for pod in active:  # the job has failed: stop the rest
                api.delete("v1", "pods", ns, pod["metadata"]["name"])
            if not [p for p in pods if p["status"].get("phase") not in _TERMINAL]:
                conditions.append(_condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"))
        elif len(succeeded) >= completions:
            conditions += [_condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
                           _condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods")]  # fmt: skip
            status["completionTime"] = now_iso()
        else:
            missing = [i for i in range(completions) if i not in succeeded and i not in active_index] if indexed else \
                [None] * max(0, completions - len(succeeded) - len(active))  # fmt: skip
            for index in missing[: max(0, parallelism - len(active))]:
                api.create("v1", "pods", ns, _job_pod(job, index))
        status["conditions"] = conditions
        if status != (job.get("status") or {}):
            api.patch("batch/v1", "jobs", ns, meta["name"], {"status": status}, status=True)


# --- JobSet controller ----------------------------------------------------------------------------


def _child_job(js: dict, rjob: dict, i: int, attempt: int, subdomain: str | None) -> dict:
    name = js["metadata"]["name"]
    labels = {JS_NAME: name, JS_RJOB: rjob["name"], JS_INDEX: str(i), JS_ATTEMPT: str(attempt)}
    template = copy.deepcopy(rjob["template"])
    pod = template["spec"]["template"]
    pod_meta = pod.setdefault("metadata", {})
    pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **labels}
    pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), **labels}
    if subdomain:
        pod["spec"]["subdomain"] = subdomain  # pod i answers as <job>-<i>.<subdomain>
    meta = template.get("metadata") or {}
    return {"apiVersion": "batch/v1", "kind": "Job", "spec": template["spec"],
            "metadata": {"name": f"{name}-{rjob['name']}-{i}", "namespace": js["metadata"]["namespace"],
                         "labels": {**(meta.get("labels") or {}), **labels},
                         "annotations": {**(meta.get("annotations") or {}), **labels},
                         "ownerReferences": [_owner(js)]}}  # fmt: skip


def sync_jobsets(api: Rest) -> None:
    for js in api.list(JOBSET, "jobsets"):
        meta, spec, status = js["metadata"], js["spec"], dict(js.get("status") or {})
        done = _true(js) & {"Completed", "Failed"}
        if done:
            _expire(api, js, "jobsets")
        if meta.get("deletionTimestamp") or done or spec.get("suspend"):
            continue
        ns, name, attempt = meta["namespace"], meta["name"], int(status.get("restarts", 0))
        network = spec.get("network") or {}
        subdomain = network.get("subdomain") or name if network.get("enableDNSHostnames", True) else None
        if subdomain:
            service = {"apiVersion": "v1", "kind": "Service",
                       "metadata": {"name": subdomain, "namespace": ns, "ownerReferences": [_owner(js)]},
                       "spec": {"clusterIP": "None", "selector": {JS_NAME: name},
                                "publishNotReadyAddresses": bool(network.get("publishNotReadyAddresses", True))}}  # fmt: skip
            try:
                api.create("v1", "services", ns, service)
            except RestError as err:
                if err.code != 409:
                    raise
        jobs = [j for j in api.list("batch/v1", "jobs", ns, labels=f"{JS_NAME}={name}")
                if any(r.get("uid") == meta["uid"] for r in j["metadata"].get("ownerReferences") or [])]  # fmt: skip
        current = [j for j in jobs if j["metadata"]["labels"].get(JS_ATTEMPT) == str(attempt)]
        if not jobs:  # a first start, or the previous attempt's jobs are all gone
            for rjob in spec["replicatedJobs"]:
                for i in range(int(rjob.get("replicas", 1))):
                    api.create("batch/v1", "jobs", ns, _child_job(js, rjob, i, attempt, subdomain))
            continue
        rstatus = []
        for rjob in spec["replicatedJobs"]:
            mine = [j for j in current if j["metadata"]["labels"].get(JS_RJOB) == rjob["name"]]
            rstatus.append({"name": rjob["name"],
                            "ready": sum(1 for j in mine if (j.get("status") or {}).get("ready", 0) > 0),
                            "succeeded": sum(1 for j in mine if "Complete" in _true(j)),
                            "failed": sum(1 for j in mine if "Failed" in _true(j)),
                            "active": sum(1 for j in mine if (j.get("status") or {}).get("active", 0) > 0 and not _true(j) & {"Complete", "Failed"}),
                            "suspended": 0})  # fmt: skip
        status["replicatedJobsStatus"] = rstatus
        conditions = list(status.get("conditions") or [])
        expected = sum(int(r.get("replicas", 1)) for r in spec["replicatedJobs"])
        if any("Failed" in _true(j) for j in current):
            if attempt < int((spec.get("failurePolicy") or {}).get("maxRestarts", 0)):
                for j in jobs:  # restart the whole group: every job of this attempt goes, then all are recreated
                    api.delete("batch/v1", "jobs", ns, j["metadata"]["name"], "Foreground")
                status["restarts"] = attempt + 1
            else:
                conditions.append(_condition("Failed", "FailedJobs", "jobset failed due to one or more job failures"))
        elif len(current) == expected and all("Complete" in _true(j) for j in current):
            conditions.append(_condition("Completed", "AllJobsCompleted", "jobset completed successfully"))
        status["conditions"] = conditions
        if status != (js.get("status") or {}):
            api.patch(JOBSET, "jobsets", ns, name, {"status": status}, status=True)


# --- garbage collector ----------------------------------------------------------------------------

_OWNED_KINDS = [("v1", "pods"), ("v1", "services"), ("v1", "configmaps"), ("batch/v1", "jobs"),
                (JOBSET, "jobsets"), ("kubeflow.org/v1", "pytorchjobs")]  # fmt: skip


_PLURAL = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Job": "jobs", "JobSet": "jobsets",
           "PyTorchJob": "pytorchjobs"}  # fmt: skip


def _orphaned(api: Rest, version: str, plural: str, obj: dict) -> bool:
    """True when none of the object's owners exists, checked live (the lists are a moment old: an owner
    deleted with Orphan has already let go of this object), as the real collector re-reads before deleting."""
    meta = obj["metadata"]
    try:
        refs = api.call("GET", object_path(version, plural, meta.get("namespace"), meta["name"]))["metadata"].get(
            "ownerReferences") or []  # fmt: skip
    except RestError as err:
        if err.code == 404:
            return False  # gone already
        raise
    for ref in refs:
        try:
            owner = api.call("GET", object_path(ref["apiVersion"], _PLURAL.get(ref["kind"], ""), meta.get("namespace"), ref["name"]))
        except RestError as err:
            if err.code == 404:
                continue
            raise
        if owner["metadata"]["uid"] == ref.get("uid"):
            return False
    return bool(refs)


def collect_garbage(api: Rest) -> None:
    objects = [(v, p, o) for v, p in _OWNED_KINDS for o in api.list(v, p)]
    alive = {o["metadata"]["uid"] for _, _, o in objects}
    for version, plural, obj in objects:
        meta = obj["metadata"]
        refs = meta.get("ownerReferences") or []
        if refs and not any(r.get("uid") in alive for r in refs) and _orphaned(api, version, plural, obj):
            api.delete(version, plural, meta.get("namespace"), meta["name"], "Background")
            continue
        if meta.get("deletionTimestamp") and "foregroundDeletion" in (meta.get("finalizers") or []):
            dependents = [(v, p, o) for v, p, o in objects
                          if any(r.get("uid") == meta["uid"] for r in o["metadata"].get("ownerReferences") or [])]  # fmt: skip
            for v, p, o in dependents:
                if not o["metadata"].get("deletionTimestamp"):
                    api.delete(v, p, o["metadata"].get("namespace"), o["metadata"]["name"], "Foreground")
            if not dependents:
                rest = [f for f in meta["finalizers"] if f != "foregroundDeletion"]
                api.patch(version, plural, meta.get("namespace"), meta["name"], {"metadata": {"finalizers": rest}})


# --- the manager ----------------------------------------------------------------------------------


class ControllerManager:
    """All controllers, one reconcile pass each every `period_s`, in one thread."""

    def __init__(self, server: str, period_s: float = 0.2):
        self.api, self.period_s = Rest(server), period_s
        self.jobs = JobController()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k8s-controllers", daemon=True)

    def reconcile_once(self) -> None:
        for step in (collect_garbage, sync_jobsets, self.jobs.sync, schedule):
            try:
                step(self.api)
            except Exception as exc:  # one failing pass must not stop the others; the next pass retries
                log.warning("controller %s: %s", getattr(step, "__name__", step), exc)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.reconcile_once()

    def start(self) -> "ControllerManager":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
