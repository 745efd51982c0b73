"""The stand-in API server's HTTP side: Kubernetes REST paths (/api/v1/..., /apis/GROUP/VERSION/...),
discovery, Status errors, and the pod subresources our jobs use (status, binding, log).

Watches stream one JSON event per line (ADDED, MODIFIED, DELETED) as kube-apiserver's do, so
kubectl's `wait` and `delete --wait` and client watches work. What it does not do, on purpose:
authentication (the kubeconfig's token is accepted as is), admission plugins, the OpenAPI document
(kubectl needs --validate=false), and JSON patch (merge patch only)."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from infra.k8s.objects import BY_PATH, RESOURCES, ApiError, ObjectStore, Resource

SERVER_VERSION = {"major": "1", "minor": "33", "gitVersion": "v1.33.0-eightfold-standin", "platform": "linux/amd64"}


def pod_log_file(log_root: Path, namespace: str, pod: str, uid: str, container: str) -> Path:
    """Where the node writes a container's output (the kubelet's /var/log/pods/NS_POD_UID/CONTAINER/ layout)."""
    return Path(log_root) / f"{namespace}_{pod}_{uid}" / container / "0.log"


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, log_root: Path, host: str = "127.0.0.1", port: int = 0):
        self.store = ObjectStore()
        self.log_root = Path(log_root)
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"


def _discovery(path: list[str]) -> dict | None:
    if path == ["version"]:
        return SERVER_VERSION
    if path == ["api"]:
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}  # fmt: skip
    if path == ["apis"]:
        groups = sorted({(r.group, r.version) for r in RESOURCES if r.group})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
             "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}} for g, v in groups]}  # fmt: skip
    group, version = ("", path[1]) if path[0] == "api" and len(path) == 2 else (
        (path[1], path[2]) if path[0] == "apis" and len(path) == 3 else (None, None))  # fmt: skip
    if group is None:
        return None
    resources = []
    for r in RESOURCES:
        if (r.group, r.version) != (group, version):
            continue
        verbs = ["create", "delete", "get", "list", "patch", "update"]
        resources.append({"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                          "kind": r.kind, "verbs": verbs})  # fmt: skip
        subs = (["status"] if r.status_subresource else []) + (["binding", "log"] if r.kind == "Pod" else [])
        resources += [{"name": f"{r.plural}/{s}", "singularName": "", "namespaced": r.namespaced, "kind": r.kind,
                       "verbs": ["get", "patch", "update", "create"]} for s in subs]  # fmt: skip
    if not resources:
        return None
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}


def _route(parts: list[str]) -> tuple[Resource, str | None, str | None, str | None]:
    """(resource, namespace, name, subresource) of an object path; ApiError 404 for any other path."""
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource: /{'/'.join(parts)}")
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    res = BY_PATH.get((group, version, rest[0]))
    if res is None or (namespace is not None and not res.namespaced) or len(rest) > 3:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource: /{'/'.join(parts)}")
    return res, namespace, (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # one line per request otherwise
        pass

    def _send(self, code: int, body: dict | str, content_type: str = "application/json") -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_stream(self, content_type: str) -> None:
        """A streamed answer (a watch, a followed log), chunked as kube-apiserver sends it: clients
        read each chunk as it comes instead of waiting for a buffer to fill."""
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        """One chunk; empty data ends the stream."""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return {}
        try:
            return json.loads(self.rfile.read(length))
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequest", f"the request body is not JSON: {exc}") from None

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [p for p in url.path.split("/") if p]
        try:
            if method == "GET" and (found := _discovery(parts)) is not None:
                return self._send(200, found)
            res, ns, name, sub = _route(parts)
            body = self._body() if method in ("POST", "PUT", "PATCH", "DELETE") else {}
            self._dispatch(method, res, ns, name, sub, query, body)
        except ApiError as err:
            self._send(err.code, err.status())
        except (BrokenPipeError, ConnectionResetError):  # the client went away (a watch it stopped)
            pass

    def _dispatch(self, method, res, ns, name, sub, query, body) -> None:
        store = self.server.store
        if sub not in (None, "status", "binding", "log") or (sub in ("binding", "log") and res.kind != "Pod"):
            raise ApiError(404, "NotFound", f"{res.plural} has no subresource {sub!r}")
        if method == "GET" and name is None:
            if query.get("watch") in ("true", "1"):
                return self._watch(res, ns, query)
            return self._send(200, store.list(res, ns, query.get("labelSelector"), query.get("fieldSelector")))
        if method == "GET" and sub == "log":
            return self._pod_log(ns, name, query)
        if method == "GET":
            return self._send(200, store.get(res, ns, name))
        if method == "POST" and sub == "binding":
            return self._bind(ns, name, body)
        if method == "POST" and name is None:
            return self._send(201, store.create(res, ns, body))
        if method == "PUT" and name and sub in (None, "status"):
            return self._send(200, store.update(res, ns, name, body, status=sub == "status"))
        if method == "PATCH" and name and sub in (None, "status"):
            kind = (self.headers.get("Content-Type") or "").split(";")[0]
            if kind not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                raise ApiError(415, "UnsupportedMediaType", f"patch type {kind!r}: the stand-in takes merge patches only")
            return self._send(200, store.patch(res, ns, name, body, status=sub == "status"))
        if method == "DELETE" and name and sub is None:
            propagation = body.get("propagationPolicy") or query.get("propagationPolicy")
            grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
            return self._send(200, store.delete(res, ns, name, propagation, None if grace is None else int(grace)))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on this path")

    def _watch(self, res: Resource, ns: str | None, query: dict) -> None:
        started = False

        def send(event: dict) -> None:
            nonlocal started
            if not started:  # headers only once the watch is accepted (a 410 is still a plain answer)
                self._start_stream("application/json")
                started = True
            if event:
                self._chunk(json.dumps(event).encode() + b"\n")

        timeout = float(query.get("timeoutSeconds") or 1800)
        self.server.store.watch(res, ns, query.get("labelSelector"), query.get("fieldSelector"),
                                query.get("resourceVersion"), timeout, send)  # fmt: skip
        send({})  # a watch that saw nothing still answers 200, with an empty stream
        self._chunk(b"")

    def _bind(self, ns: str, name: str, body: dict) -> None:
        """POST pods/NAME/binding: what the scheduler does; a pod binds once."""
        node = ((body.get("target") or {}).get("name")) or ""
        pods = BY_PATH[("", "v1", "pods")]
        pod = self.server.store.get(pods, ns, name)
        if (pod.get("spec") or {}).get("nodeName"):
            raise ApiError(409, "Conflict", f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        self.server.store.patch(pods, ns, name, {"spec": {"nodeName": node}}, status=False)
        self._send(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})

    def _pod_log(self, ns: str, name: str, query: dict) -> None:
        pod = self.server.store.get(BY_PATH[("", "v1", "pods")], ns, name)
        main = [c["name"] for c in pod["spec"].get("containers") or []]
        containers = main + [c["name"] for c in pod["spec"].get("initContainers") or []]
        container = query.get("container") or (main[0] if len(main) == 1 else None)
        if container not in containers:
            raise ApiError(400, "BadRequest", f"a container name must be specified for pod {name}, choose one of: {containers}")
        path = pod_log_file(self.server.log_root, ns, name, pod["metadata"]["uid"], container)
        if not path.exists():
            raise ApiError(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
        if query.get("follow") not in ("true", "1"):
            text = path.read_text(errors="replace")
            if query.get("tailLines"):
                text = "".join(text.splitlines(keepends=True)[-int(query["tailLines"]):])
            return self._send(200, text, "text/plain")
        # follow: stream until the container ends (its pod finished or went away).
        self._start_stream("text/plain")
        with open(path, "rb") as f:
            while True:
                chunk = f.read(65536)
                if chunk:
                    self._chunk(chunk)
                    continue
                try:
                    phase = self.server.store.get(BY_PATH[("", "v1", "pods")], ns, name)["status"].get("phase")
                except ApiError:
                    phase = "Gone"
                if phase in ("Succeeded", "Failed", "Gone"):
                    if rest := f.read():
                        self._chunk(rest)
                    return self._chunk(b"")
                time.sleep(0.2)

    def do_GET(self) -> None:  # noqa: N802
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._serve("PATCH")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")
