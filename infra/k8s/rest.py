"""A small JSON client of the Kubernetes REST API for the stand-in's controllers and node: they see the
cluster only through the API, as kube-controller-manager and the kubelet do."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import urlencode


class RestError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason = code, reason


def object_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    return f"{path}/{name}" if name else path


class Rest:
    def __init__(self, server: str, timeout: float = 10.0):
        self.server, self.timeout = server.rstrip("/"), timeout

    def call(self, method: str, path: str, body: dict | None = None, query: dict | None = None,
             content_type: str = "application/json") -> dict:  # fmt: skip
        url = self.server + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            try:
                status = json.loads(err.read())
            except ValueError:
                status = {}
            raise RestError(err.code, status.get("reason", ""), status.get("message", str(err))) from None

    def list(self, api_version: str, plural: str, namespace: str | None = None, labels: str | None = None,
             fields: str | None = None) -> list[dict]:  # fmt: skip
        query = {k: v for k, v in (("labelSelector", labels), ("fieldSelector", fields)) if v}
        return self.call("GET", object_path(api_version, plural, namespace), query=query)["items"]

    def create(self, api_version: str, plural: str, namespace: str | None, body: dict) -> dict:
        return self.call("POST", object_path(api_version, plural, namespace), body)

    def patch(self, api_version: str, plural: str, namespace: str | None, name: str, patch: dict,
              status: bool = False) -> dict:  # fmt: skip
        path = object_path(api_version, plural, namespace, name) + ("/status" if status else "")
        return self.call("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, api_version: str, plural: str, namespace: str | None, name: str,
               propagation: str | None = None, grace: int | None = None) -> dict | None:  # fmt: skip
        body = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if propagation:
            body["propagationPolicy"] = propagation
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            return self.call("DELETE", object_path(api_version, plural, namespace, name), body)
        except RestError as err:
            if err.code == 404:  # already gone: what the caller wanted
                return None
            raise
