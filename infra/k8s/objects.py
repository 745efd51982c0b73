"""The API server's object store: Kubernetes objects by (group, version, plural, namespace, name) with
the metadata, defaults, deletion and validation rules of kube-apiserver that our jobs meet.

Deletion is the real protocol: a bound, running pod is only marked (deletionTimestamp) until its node
has stopped it and deletes it with grace 0; `Foreground` propagation keeps the owner with the
`foregroundDeletion` finalizer until the garbage collector has deleted its dependents; `Background`
deletes the owner now and leaves the dependents to the collector; `Orphan` (batch/v1 Jobs' default)
strips the owner reference from them. An object with finalizers left goes when the last is removed."""

from __future__ import annotations

import copy
import re
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An error the API answers as a Status object: code, reason (NotFound, Conflict ...), message."""

    def __init__(self, code: int, reason: str, message: str, causes: list[dict] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.causes = code, reason, message, causes or []

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}  # fmt: skip
        if self.causes:
            body["details"] = {"causes": self.causes}
        return body


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    model: str | None = None  # kubernetes.client model that validates a created object

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = [
    Resource("", "v1", "namespaces", "Namespace", namespaced=False, model="V1Namespace"),
    Resource("", "v1", "nodes", "Node", namespaced=False, status_subresource=True, model="V1Node"),
    Resource("", "v1", "configmaps", "ConfigMap", model="V1ConfigMap"),
    Resource("", "v1", "secrets", "Secret", model="V1Secret"),
    Resource("", "v1", "services", "Service", status_subresource=True, model="V1Service"),
    Resource("", "v1", "pods", "Pod", status_subresource=True, model="V1Pod"),
    Resource("", "v1", "events", "Event", model="CoreV1Event"),
    Resource("batch", "v1", "jobs", "Job", status_subresource=True, model="V1Job"),
    # Custom resources, as their CRDs declare them (status subresource on).
    Resource("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet", status_subresource=True),
    Resource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", status_subresource=True),
]
BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
BY_KIND = {r.kind: r for r in RESOURCES}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _validation_problems(res: Resource, obj: dict) -> list[str]:
    """What kube-apiserver would reject: the OpenAPI types (the client's pydantic models, unknown fields
    included), a DNS name, containers with images; JobSet and PyTorchJob through their CRD schemas."""
    from infra.launch import kubernetes as launcher

    problems: list[str] = []
    name = (obj.get("metadata") or {}).get("name", "")
    if not isinstance(name, str) or not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
        problems.append(f"metadata.name: {name!r} is not a DNS subdomain")
    if res.kind in ("JobSet", "PyTorchJob"):
        return problems + launcher.manifest_problems(obj)
    if res.model:
        from kubernetes import client

        problems += launcher._model_problems(getattr(client, res.model), obj, "")
    if res.kind == "Pod":
        for i, c in enumerate(((obj.get("spec") or {}).get("containers")) or []):
            if not c.get("image"):
                problems.append(f"spec.containers[{i}].image: Required value")
    return problems


def _defaults(res: Resource, obj: dict) -> None:
    """The defaults and generated fields kube-apiserver adds on create."""
    meta, spec = obj["metadata"], obj.setdefault("spec", {}) if res.kind in ("Pod", "Job", "Service") else None
    if res.kind == "Pod":
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("dnsPolicy", "ClusterFirst")
        obj["status"] = {"phase": "Pending"}
    elif res.kind == "Job":
        # The Job strategy labels the pod template and selects on the job's own uid (manualSelector off).
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        spec.setdefault("completionMode", "NonIndexed")
        labels = {"batch.kubernetes.io/controller-uid": meta["uid"], "batch.kubernetes.io/job-name": meta["name"],
                  "controller-uid": meta["uid"], "job-name": meta["name"]}  # fmt: skip
        template_meta = spec.setdefault("template", {}).setdefault("metadata", {})
        template_meta["labels"] = {**(template_meta.get("labels") or {}), **labels}
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": meta["uid"]}}
        obj["status"] = {}
    elif res.kind == "Secret":  # stringData is write-only: the API stores it base64-encoded in data
        import base64

        for k, v in (obj.pop("stringData", None) or {}).items():
            obj.setdefault("data", {})[k] = base64.b64encode(str(v).encode()).decode()
    elif res.kind == "Service":
        spec.setdefault("type", "ClusterIP")
        obj["status"] = {"loadBalancer": {}}
    elif res.status_subresource:
        obj["status"] = {}


# --- selectors ------------------------------------------------------------------------------------

_SET_TERM = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_label_selector(text: str | None) -> Callable[[dict], bool]:
    """Kubernetes label selector syntax: a=b, a==b, a!=b, a, !a, a in (x,y), a notin (x,y)."""
    terms = []
    for raw in re.split(r",(?![^()]*\))", text or ""):
        term = raw.strip()
        if not term:
            continue
        if m := _SET_TERM.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            terms.append(lambda labels, k=key, o=op, v=values: (labels.get(k) in v) == (o == "in"))
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            terms.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            terms.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            terms.append(lambda labels, k=term[1:].strip(): k not in labels)
        else:
            terms.append(lambda labels, k=term: k in labels)
    return lambda obj: all(t((obj.get("metadata") or {}).get("labels") or {}) for t in terms)


def parse_field_selector(text: str | None) -> Callable[[dict], bool]:
    """Field selectors as the API takes them: dotted paths with = or != (spec.nodeName=n, status.phase!=Failed)."""
    terms = []
    for term in filter(None, (t.strip() for t in (text or "").split(","))):
        negate = "!=" in term
        path, value = (s.strip() for s in term.replace("==", "=").split("!=" if negate else "=", 1))
        terms.append((path.split("."), value, negate))

    def field(obj: dict, path: list[str]) -> str:
        for part in path:
            obj = obj.get(part) if isinstance(obj, dict) else None
        return "" if obj is None else str(obj)

    return lambda obj: all((field(obj, p) == v) != neg for p, v, neg in terms)


# --- the store ------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what the client sends for a dict body; strategic merge is treated alike)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class ObjectStore:
    """All objects, under one lock; every write bumps the global resourceVersion and records a watch
    event (ADDED, MODIFIED, DELETED), the last MAX_EVENTS of them kept for watches to resume from."""

    MAX_EVENTS = 5000

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._objects: dict[tuple, dict] = {}
        self._events: list[tuple[int, str, tuple, dict]] = []  # (resourceVersion, type, key, object)
        self._rv = 0
        for ns in ("default", "kube-system"):
            self.create(BY_KIND["Namespace"], None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

    def _bump(self, obj: dict, event: str = "MODIFIED", key: tuple | None = None) -> dict:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = key or next(k for k, o in self._objects.items() if o is obj)
        self._events.append((self._rv, event, key, copy.deepcopy(obj)))
        del self._events[: -self.MAX_EVENTS]
        self._changed.notify_all()
        return obj

    def _remove(self, key: tuple) -> dict:
        obj = self._objects.pop(key)
        return self._bump(obj, "DELETED", key)

    @staticmethod
    def _key(res: Resource, namespace: str | None, name: str) -> tuple:
        return (res.group, res.plural, namespace or "", name)

    def _find(self, res: Resource, namespace: str | None, name: str) -> dict:
        obj = self._objects.get(self._key(res, namespace, name))
        if obj is None:
            plural = f"{res.plural}.{res.group}" if res.group else res.plural
            raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
        return obj

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self._find(res, namespace, name))

    def list(self, res: Resource, namespace: str | None, labels: str | None = None, fields: str | None = None) -> dict:
        match_labels, match_fields = parse_label_selector(labels), parse_field_selector(fields)
        with self._lock:
            items = [copy.deepcopy(o) for (g, p, ns, _), o in sorted(self._objects.items())
                     if (g, p) == (res.group, res.plural) and (namespace is None or ns == namespace)
                     and match_labels(o) and match_fields(o)]  # fmt: skip
            return {"kind": f"{res.kind}List", "apiVersion": res.api_version,
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}  # fmt: skip

    def create(self, res: Resource, namespace: str | None, body: dict) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if res.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the namespace on the request")
            meta["namespace"] = namespace
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        problems = _validation_problems(res, obj)
        if problems:
            raise ApiError(422, "Invalid", f'{res.kind} "{meta.get("name")}" is invalid: ' + "; ".join(problems),
                           [{"message": p} for p in problems])  # fmt: skip
        with self._lock:
            if res.namespaced and self._key(BY_KIND["Namespace"], None, namespace) not in self._objects:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
            key = self._key(res, namespace, meta["name"])
            if key in self._objects:
                raise ApiError(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
            for drop in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
                meta.pop(drop, None)
            _defaults(res, obj)
            self._objects[key] = self._bump(obj, "ADDED", key)
            return copy.deepcopy(obj)

    def update(self, res: Resource, namespace: str | None, name: str, body: dict, status: bool) -> dict:
        """PUT: the whole object (status ignored) or, on /status, the status only. A stale resourceVersion
        is a Conflict, as for any optimistic-concurrency write."""
        with self._lock:
            current = self._find(res, namespace, name)
            sent_rv = (body.get("metadata") or {}).get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": '
                               "the object has been modified; please apply your changes to the latest version")  # fmt: skip
            new = copy.deepcopy(current)
            if status:
                new["status"] = copy.deepcopy(body.get("status") or {})
            else:
                keep = {k: current["metadata"][k] for k in ("uid", "creationTimestamp", "name", "namespace",
                        "deletionTimestamp", "deletionGracePeriodSeconds", "generation") if k in current["metadata"]}  # fmt: skip
                new = {**copy.deepcopy(body), "apiVersion": res.api_version, "kind": res.kind}
                new["metadata"] = {**(body.get("metadata") or {}), **keep}
                if res.status_subresource:
                    new["status"] = copy.deepcopy(current.get("status") or {})
                if new.get("spec") != current.get("spec"):
                    new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            return self._store_or_finalize(res, namespace, name, new)

    def patch(self, res: Resource, namespace: str | None, name: str, patch: dict, status: bool) -> dict:
        with self._lock:
            current = self._find(res, namespace, name)
            merged = merge_patch(current, patch)
            body = {**current, "status": merged.get("status")} if status else merged
            return self.update(res, namespace, name, body, status)

    def _store_or_finalize(self, res: Resource, namespace: str | None, name: str, obj: dict) -> dict:
        meta = obj["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(self._key(res, namespace, name))  # the last finalizer is gone
            return obj
        key = self._key(res, namespace, name)
        self._objects[key] = self._bump(obj, "MODIFIED", key)
        return copy.deepcopy(obj)

    def delete(self, res: Resource, namespace: str | None, name: str, propagation: str | None, grace: int | None) -> dict:
        with self._lock:
            obj = self._find(res, namespace, name)
            meta = obj["metadata"]
            phase = (obj.get("status") or {}).get("phase")
            if res.kind == "Pod" and (obj.get("spec") or {}).get("nodeName") and phase not in ("Succeeded", "Failed"):
                if grace == 0 and meta.get("deletionTimestamp"):  # the node has stopped it
                    return copy.deepcopy(self._remove(self._key(res, namespace, name)))
                if grace != 0:  # a graceful delete: the node stops the containers, then finishes the delete
                    if not meta.get("deletionTimestamp"):
                        meta["deletionTimestamp"] = now_iso()
                        spec_grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                        meta["deletionGracePeriodSeconds"] = spec_grace if grace is None else grace
                        self._bump(obj)
                    return copy.deepcopy(obj)
            if propagation is None:  # batch/v1 Jobs orphan their pods unless told otherwise
                propagation = "Orphan" if res.kind == "Job" else "Background"
            if propagation not in ("Orphan", "Background", "Foreground"):
                raise ApiError(400, "BadRequest", f"propagationPolicy {propagation!r}: must be Orphan, Background or Foreground")
            if propagation == "Orphan":
                self._orphan_dependents(meta["uid"])
            finalizers = list(meta.get("finalizers") or [])
            if propagation == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            if finalizers:
                meta["finalizers"] = finalizers
                meta.setdefault("deletionTimestamp", now_iso())
                self._bump(obj)
                return copy.deepcopy(obj)
            return copy.deepcopy(self._remove(self._key(res, namespace, name)))

    def watch(self, res: Resource, namespace: str | None, labels: str | None, fields: str | None,
              since: str | None, timeout_s: float, send: Callable[[dict], None]) -> None:  # fmt: skip
        """Stream watch events to `send` until `timeout_s`: with no resourceVersion (or "0"), first an ADDED
        for every object that matches now; then each change after it. 410 Gone when `since` is older
        than the events kept, as the API answers a watch that must list again."""
        match_labels, match_fields = parse_label_selector(labels), parse_field_selector(fields)
        deadline = time.monotonic() + timeout_s

        def wanted(key: tuple, obj: dict) -> bool:
            return key[:2] == (res.group, res.plural) and namespace in (None, key[2]) and match_labels(obj) and match_fields(obj)

        with self._lock:
            if since in (None, "", "0"):
                pending = [{"type": "ADDED", "object": copy.deepcopy(o)} for k, o in sorted(self._objects.items()) if wanted(k, o)]
                last = self._rv
            else:
                last = int(since)
                if self._events and last < self._events[0][0] - 1:
                    raise ApiError(410, "Expired", f"too old resource version: {last} ({self._events[0][0] - 1})")
                pending = []
        while True:
            for event in pending:
                send(event)
            with self._lock:
                while not (fresh := [e for e in self._events if e[0] > last]):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._changed.wait(min(left, 1.0))
                last = fresh[-1][0]
                pending = [{"type": t, "object": copy.deepcopy(o)} for _, t, k, o in fresh if wanted(k, o)]

    def _orphan_dependents(self, uid: str) -> None:
        for obj in self._objects.values():
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                obj["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                self._bump(obj)
