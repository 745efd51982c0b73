"""The stand-in node: a kubelet without a container runtime. It registers a Node, and for every pod
bound to it runs each container's command as a local process in its own PID, mount and UTS
namespaces (`unshare`), so the pod sees what a container would, and dies as a container does (when
its PID 1 ends, the kernel kills every process of the namespace, whatever session it started):
- its own IP, a loopback address 127.0.x.y (so a reverse lookup names the pod, as torchrun's
  rendezvous needs to tell pods apart: with one shared address every pod would be "localhost");
- its hostname (spec.hostname, else the pod name) and a hosts file naming every pod of this node by
  <hostname>.<subdomain>[.<ns>.svc.cluster.local] (what the cluster DNS answers for a headless service);
- its volumes at their mountPaths: configMap and secret files, emptyDir folders (medium Memory a tmpfs
  of sizeLimit), read-only where asked;
- exactly its env: env (value, fieldRef, secretKeyRef, configMapKeyRef), envFrom, $(VAR) expansion in
  command and args, over the "image's" env (this machine's Python first on PATH, the project on
  PYTHONPATH: the image is this checkout);
- /tmp, /var/tmp, /home and /root empty (its own tmpfs) but for the project and its Python inside them
  (the "image", mounted back at their paths): a pod cannot see the test's or the orchestrator's local
  files, only the object store, as on a cluster;
- its init containers first, in order (each in namespaces of its own, sharing the pod's volumes);
- SIGTERM to its PID 1 on deletion, SIGKILL to the namespace after the grace period.
Its phase, container states, exit codes and restarts go back through pods/NAME/status; its output
goes to the log file the API server's pods/NAME/log reads. Needs root (mount namespaces)."""

from __future__ import annotations

import base64
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.k8s.apiserver import pod_log_file
from infra.k8s.objects import now_iso
from infra.k8s.rest import Rest, RestError

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# A pod's namespaces: PID (with its own /proc), mount, hostname. --fork: the pod's first process is PID 1.
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", "--propagation", "private"]
_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class PodConfigError(Exception):
    """A pod that cannot start yet: a missing ConfigMap or Secret, an unsupported volume (CreateContainerConfigError)."""


def node_can_run_pods() -> str | None:
    """Why pods cannot run on this machine (None when they can): the node needs root and `unshare`."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "util-linux's unshare and mount are not installed"
    if os.geteuid() != 0:
        return "the stand-in node needs root for its pods' mount namespaces"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True)
    if probe.returncode != 0:
        return f"{' '.join(UNSHARE)} fails here: {probe.stderr.decode(errors='replace').strip()}"
    return None


def default_image_env() -> dict[str, str]:
    """The env the "image" sets: this Python's bin folder first on PATH, the project importable."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8", "PYTHONPATH": str(PROJECT_ROOT)}  # fmt: skip


PRIVATE_DIRS = ("/tmp", "/var/tmp", "/home", "/root")
# Where the "image" (the project, its Python) is held while a private folder above it is emptied; a
# folder of this machine's that no pod's private folder covers.
HOLD_ROOT = Path("/run/eightfold-standin")


def image_paths() -> list[Path]:
    """What the "image" is made of: the project and its Python (the outermost folders only)."""
    paths = {PROJECT_ROOT.resolve(), Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
             Path(sys.executable).resolve().parent}  # fmt: skip
    return sorted(p for p in paths if not any(q != p and q in p.parents for q in paths))


def private_dirs() -> list[tuple[Path, list[Path]]]:
    """Folders each pod gets empty (a tmpfs of its own), as a container's image would not have this
    machine's: where tests, workspaces and local stores live; each with the parts of the image inside
    it, which the pod sees again at their own paths (a checkout under /tmp stays runnable, the rest of
    /tmp does not show)."""
    out = []
    for d in map(Path, PRIVATE_DIRS):
        if d.is_dir():
            out.append((d, [p for p in image_paths() if d == p or d in p.parents]))
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined name is replaced, $$(VAR) escapes, anything else stays."""
    return re.sub(r"\$\$\(|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$(" if m.group(1) is None else env.get(m.group(1), m.group(0)), text)  # fmt: skip


def _quantity_bytes(value: str) -> int:
    from kubernetes.utils.quantity import parse_quantity

    return int(parse_quantity(value))


@dataclass
class Step:
    """One container of a pod: its script, its log, how it ended."""

    name: str
    image: str
    script: str
    log_file: Path
    started_at: str = ""
    restarts: int = 0
    last_state: dict = field(default_factory=dict)
    terminated: dict | None = None


@dataclass
class Container:
    """A pod's run on this node: its init containers, in order, then its one container."""

    pod_dir: Path
    steps: list[Step]
    current: int = 0
    proc: subprocess.Popen | None = None
    term_sent_at: float | None = None

    @property
    def step(self) -> Step:
        return self.steps[self.current]

    @property
    def in_init(self) -> bool:
        return self.current < len(self.steps) - 1


class NodeAgent:
    def __init__(self, server: str, root: Path, name: str = "standin-node-0", labels: dict[str, str] | None = None,
                 image_env: dict[str, str] | None = None, period_s: float = 0.2, log_root: Path | None = None):  # fmt: skip
        self.api, self.root, self.name, self.period_s = Rest(server), Path(root), name, period_s
        self.labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
        self.image_env = image_env or default_image_env()
        # where the API server reads pods' logs (`kubectl logs`); shared by the nodes of one stand-in
        self.log_root = Path(log_root) if log_root else self.root / "logs"
        self.hosts_file = self.root / "hosts"
        self.containers: dict[str, Container] = {}  # pod uid -> its (one) running container
        self.pod_ips: dict[str, str] = {}  # pod uid -> its loopback address
        self.created_dirs: list[Path] = []  # mount points made on this machine, removed at stop
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"k8s-node-{name}", daemon=True)

    # --- registration and the loop ----------------------------------------------------------------

    def register(self) -> None:
        meminfo = Path("/proc/meminfo").read_text()
        mem_kib = int(re.search(r"MemTotal:\s+(\d+)", meminfo).group(1))
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": self.labels}}
        try:
            self.api.create("v1", "nodes", None, node)
        except RestError as err:
            if err.code != 409:
                raise
        status = {"allocatable": {"cpu": str(os.cpu_count() or 1), "memory": f"{mem_kib}Ki", "pods": "110"},
                  "capacity": {"cpu": str(os.cpu_count() or 1), "memory": f"{mem_kib}Ki", "pods": "110"},
                  "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.name}],
                  "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                  "message": "stand-in node is posting ready status", "lastHeartbeatTime": now_iso()}]}  # fmt: skip
        self.api.patch("v1", "nodes", None, self.name, {"status": status}, status=True)

    def start(self) -> "NodeAgent":
        self.root.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text("127.0.0.1 localhost\n")
        self.register()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with self._lock:
            for c in self.containers.values():
                self._kill_group(c, signal.SIGKILL)
            self.containers.clear()
        for path in reversed(self.created_dirs):
            try:
                path.rmdir()
            except OSError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sync_once()
            except Exception as exc:  # the API may be going away at shutdown; the next pass retries
                log.warning("node %s: %s", self.name, exc)

    def sync_once(self) -> None:
        pods = self.api.list("v1", "pods", fields=f"spec.nodeName={self.name}")
        self._write_hosts(pods)
        with self._lock:
            seen = {p["metadata"]["uid"] for p in pods}
            for uid in [u for u in self.containers if u not in seen]:  # deleted outright
                self._kill_group(self.containers.pop(uid), signal.SIGKILL)
            for pod in pods:
                uid, phase = pod["metadata"]["uid"], pod["status"].get("phase")
                if pod["metadata"].get("deletionTimestamp"):
                    self._terminate(pod)
                elif uid in self.containers:
                    self._check(pod)
                elif phase == "Pending":
                    self._start(pod)

    # --- a pod's environment ----------------------------------------------------------------------

    def _read(self, kind: str, ns: str, name: str, optional: bool = False) -> dict:
        plural = "configmaps" if kind == "ConfigMap" else "secrets"
        try:
            obj = self.api.call("GET", f"/api/v1/namespaces/{ns}/{plural}/{name}")
        except RestError as err:
            if err.code == 404 and optional:
                return {}
            raise PodConfigError(f'{kind.lower()} "{name}" not found') from None
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    def _env(self, pod: dict, container: dict) -> dict[str, str]:
        meta, ns = pod["metadata"], pod["metadata"]["namespace"]
        env = dict(self.image_env)
        env["HOSTNAME"] = pod["spec"].get("hostname") or meta["name"]
        for source in container.get("envFrom") or []:
            kind, ref = ("Secret", source["secretRef"]) if "secretRef" in source else ("ConfigMap", source["configMapRef"])
            for k, v in self._read(kind, ns, ref["name"], bool(ref.get("optional"))).items():
                env[source.get("prefix", "") + k] = v
        for var in container.get("env") or []:
            if "value" in var or "valueFrom" not in var:
                env[var["name"]] = _expand(str(var.get("value", "")), env)
                continue
            src = var["valueFrom"]
            if "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                if m := _FIELD_LABEL.match(path):
                    env[var["name"]] = (meta.get(m.group(1)) or {}).get(m.group(2), "")
                else:
                    env[var["name"]] = {"metadata.name": meta["name"], "metadata.namespace": ns, "metadata.uid": meta["uid"],
                                        "spec.nodeName": self.name, "status.podIP": self._ip(pod),
                                        "status.hostIP": "127.0.0.1", "spec.serviceAccountName":
                                        pod["spec"].get("serviceAccountName", "default")}.get(path, "")  # fmt: skip
            elif "secretKeyRef" in src or "configMapKeyRef" in src:
                kind, ref = ("Secret", src["secretKeyRef"]) if "secretKeyRef" in src else ("ConfigMap", src["configMapKeyRef"])
                data = self._read(kind, ns, ref["name"], bool(ref.get("optional")))
                if ref["key"] not in data and not ref.get("optional"):
                    raise PodConfigError(f'couldn\'t find key {ref["key"]} in {kind} {ns}/{ref["name"]}')
                if ref["key"] in data:
                    env[var["name"]] = data[ref["key"]]
        return env

    def _volumes(self, pod: dict, pod_dir: Path) -> dict[str, tuple[Path, str | None]]:
        """volume name -> (folder on this machine, tmpfs size or None)."""
        out: dict[str, tuple[Path, str | None]] = {}
        ns = pod["metadata"]["namespace"]
        for vol in pod["spec"].get("volumes") or []:
            path = pod_dir / "volumes" / vol["name"]
            path.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in vol:
                spec = vol["emptyDir"] or {}
                size = spec.get("sizeLimit") if spec.get("medium") == "Memory" else None
                out[vol["name"]] = (path, str(_quantity_bytes(size)) if size else ("50%" if spec.get("medium") == "Memory" else None))
                continue
            kind, ref = ("ConfigMap", vol["configMap"]) if "configMap" in vol else (
                ("Secret", {**vol["secret"], "name": vol["secret"].get("secretName")}) if "secret" in vol else (None, None))  # fmt: skip
            if kind is None:
                raise PodConfigError(f"volume {vol['name']!r}: only configMap, secret and emptyDir volumes run on this node")
            data = self._read(kind, ns, ref["name"], bool(ref.get("optional")))
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                target = path / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(data[item["key"]])
            out[vol["name"]] = (path, None)
        return out

    def _mount_point(self, path: str) -> None:
        """Make a mount point on this machine (mkdir is not namespaced); remembered to remove at stop."""
        p = Path(path)
        missing = [q for q in [p, *p.parents] if not q.exists()]
        p.mkdir(parents=True, exist_ok=True)
        self.created_dirs += sorted(missing, key=lambda q: len(q.parts))

    def _script(self, pod: dict, container: dict, env: dict[str, str], volumes: dict) -> str:
        hostname = pod["spec"].get("hostname") or pod["metadata"]["name"]
        q = shlex.quote
        lines = ["set -e", f"hostname {q(hostname)}", f"mount --bind {q(str(self.hosts_file))} /etc/hosts"]
        for m in container.get("volumeMounts") or []:
            src, tmpfs_size = volumes[m["name"]]
            self._mount_point(m["mountPath"])
            if tmpfs_size:
                lines.append(f"mount -t tmpfs -o size={q(tmpfs_size)} tmpfs {q(m['mountPath'])}")
            else:
                lines.append(f"mount --bind {q(str(src))} {q(m['mountPath'])}")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {q(m['mountPath'])}")
        mount_paths = [Path(m["mountPath"]) for m in container.get("volumeMounts") or []]
        for private, keep in private_dirs():
            if any(p == private or private in p.parents for p in mount_paths) or private in keep:
                continue
            holds = []
            for i, path in enumerate(keep):  # held aside, then mounted back into the empty folder
                hold = HOLD_ROOT / pod["metadata"]["uid"] / f"{private.name}-{i}"
                self._mount_point(str(hold))
                lines.append(f"mount --bind {q(str(path))} {q(str(hold))}")
                holds.append((hold, path))
            lines.append(f"mount -t tmpfs tmpfs {q(str(private))}")
            for hold, path in holds:
                lines.append(f"mkdir -p {q(str(path))} && mount --bind {q(str(hold))} {q(str(path))}")
        workdir = container.get("workingDir") or "/"
        argv = [_expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
        if not argv:
            raise PodConfigError(f"container {container['name']!r} has no command: this node has no image entrypoint")
        lines.append(f"mkdir -p {q(workdir)} && cd {q(workdir)}")
        lines.append("exec env -i " + " ".join(q(f"{k}={v}") for k, v in env.items()) + " " + " ".join(map(q, argv)))
        return "\n".join(lines)

    # --- lifecycle --------------------------------------------------------------------------------

    def _start(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        if len(spec.get("containers") or []) != 1:
            return self._fail_config(pod, "this node runs pods of exactly one container (and any init containers)")
        pod_dir = self.root / "pods" / meta["uid"]
        steps = []
        try:
            volumes = self._volumes(pod, pod_dir)
            for container in [*(spec.get("initContainers") or []), spec["containers"][0]]:
                script = self._script(pod, container, self._env(pod, container), volumes)
                log_file = pod_log_file(self.log_root, meta["namespace"], meta["name"], meta["uid"], container["name"])
                steps.append(Step(container["name"], container.get("image", ""), script, log_file))
        except PodConfigError as err:
            return self._fail_config(pod, str(err))
        c = Container(pod_dir=pod_dir, steps=steps)
        self._launch(c)
        self.containers[meta["uid"]] = c
        self._report(pod, c)

    def _launch(self, c: Container) -> None:
        step = c.step
        step.started_at = now_iso()
        step.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(step.log_file, "ab") as out:
            c.proc = subprocess.Popen([*UNSHARE, "/bin/sh", "-c", step.script],
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd="/")  # fmt: skip

    def _fail_config(self, pod: dict, message: str) -> None:
        name = pod["spec"]["containers"][0]["name"] if pod["spec"].get("containers") else "?"
        waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
        status = {"containerStatuses": [{"name": name, "ready": False, "restartCount": 0, "state": waiting,
                                         "image": pod["spec"]["containers"][0].get("image", "") if name != "?" else ""}]}  # fmt: skip
        if (pod.get("status") or {}).get("containerStatuses") != status["containerStatuses"]:
            self.api.patch("v1", "pods", pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": status}, status=True)

    @staticmethod
    def _state(c: Container, i: int) -> dict:
        step = c.steps[i]
        if step.terminated is not None:
            return {"terminated": step.terminated}
        if i == c.current:
            return {"running": {"startedAt": step.started_at}}
        return {"waiting": {"reason": "PodInitializing"}}

    def _report(self, pod: dict, c: Container, phase: str | None = None) -> None:
        """Pending while init containers run, then Running, or the phase given (Succeeded, Failed)."""
        phase = phase or ("Pending" if c.in_init else "Running")
        running, initialized = phase == "Running", not c.in_init
        cond = lambda kind, ok: {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": now_iso()}  # noqa: E731
        statuses = [{"name": step.name, "image": step.image, "imageID": "", "restartCount": step.restarts,
                     "ready": running and i == len(c.steps) - 1, "started": i == c.current and step.terminated is None,
                     "state": self._state(c, i), "lastState": step.last_state} for i, step in enumerate(c.steps)]  # fmt: skip
        status = {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": self._ip(pod), "podIPs": [{"ip": self._ip(pod)}],
            "startTime": (pod.get("status") or {}).get("startTime") or c.steps[0].started_at,
            "conditions": [cond("PodScheduled", True), cond("Initialized", initialized),
                           cond("ContainersReady", running), cond("Ready", running)],
            "containerStatuses": statuses[-1:],
            "initContainerStatuses": statuses[:-1],
        }  # fmt: skip
        try:
            self.api.patch("v1", "pods", pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": status}, status=True)
        except RestError as err:
            if err.code != 404:  # a pod deleted meanwhile has nothing to report to
                raise

    @staticmethod
    def _exit_code(proc: subprocess.Popen) -> int:
        code = proc.returncode
        return 128 - code if code < 0 else code  # killed by signal N: 128+N, as container runtimes report

    def _check(self, pod: dict) -> None:
        """A container that ended: the next init container or the main one, a restart by the pod's
        restartPolicy (init containers restart unless it is Never), or the pod's last phase."""
        c = self.containers[pod["metadata"]["uid"]]
        if c.proc is None or c.proc.poll() is None:
            return
        code, step = self._exit_code(c.proc), c.step
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": step.started_at, "finishedAt": now_iso()}  # fmt: skip
        policy = pod["spec"].get("restartPolicy", "Always")
        if c.in_init and code == 0:
            step.terminated = terminated
            c.current += 1
            self._launch(c)
            return self._report(pod, c)
        if (policy == "Always" and not c.in_init) or (policy != "Never" and code != 0):
            step.restarts += 1
            step.last_state = {"terminated": terminated}
            self._launch(c)
            return self._report(pod, c)
        step.terminated = terminated
        del self.containers[pod["metadata"]["uid"]]
        self._report(pod, c, "Succeeded" if code == 0 and not c.in_init else "Failed")

    def _terminate(self, pod: dict) -> None:
        """A deleted pod: SIGTERM, SIGKILL after the grace period, then finish the delete (grace 0)."""
        uid, meta = pod["metadata"]["uid"], pod["metadata"]
        c = self.containers.get(uid)
        if c is not None and c.proc is not None and c.proc.poll() is None:
            if c.term_sent_at is None:
                c.term_sent_at = time.monotonic()
                self._signal_pid1(c, signal.SIGTERM)  # as a runtime signals the container's PID 1
                return
            if time.monotonic() - c.term_sent_at < float(meta.get("deletionGracePeriodSeconds", 30)):
                return
            self._kill_group(c, signal.SIGKILL)
            c.proc.wait(timeout=10)
        if c is not None:
            self._kill_group(c, signal.SIGKILL)
            self.containers.pop(uid, None)
        self.api.delete("v1", "pods", meta["namespace"], meta["name"], grace=0)
        shutil.rmtree(self.root / "pods" / uid, ignore_errors=True)

    @staticmethod
    def _signal_pid1(c: Container, sig: int) -> None:
        """Signal the pod's PID 1, the child `unshare --fork` made (SIGKILL to it ends the whole
        namespace). Only while unshare runs: once it is reaped its pid may belong to someone else."""
        if c.proc is None or c.proc.poll() is not None:
            return
        try:
            children = Path(f"/proc/{c.proc.pid}/task/{c.proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for pid in children or [str(c.proc.pid)]:
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass

    def _kill_group(self, c: Container, sig: int) -> None:
        """SIGKILL a pod's namespace and reap its unshare (a no-op once it has ended: the kernel
        killed everything in the namespace when its PID 1 died)."""
        self._signal_pid1(c, sig)
        if c.proc is not None and sig == signal.SIGKILL:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("pod process %s survived SIGKILL for 10 s", c.proc.pid)

    def _ip(self, pod: dict) -> str:
        uid = pod["metadata"]["uid"]
        if uid not in self.pod_ips:
            n = len(self.pod_ips)
            self.pod_ips[uid] = f"127.0.{1 + n // 250 % 250}.{1 + n % 250}"
        return self.pod_ips[uid]

    def _write_hosts(self, pods: list[dict]) -> None:
        """What cluster DNS would answer, as /etc/hosts lines, a pod's fully qualified name first (what a
        reverse lookup of its IP gives). Rewritten in place so the pods' bind mounts (of this inode)
        see new pods too."""
        lines = ["127.0.0.1 localhost"]
        for pod in pods:
            host = pod["spec"].get("hostname") or pod["metadata"]["name"]
            sub, ns = pod["spec"].get("subdomain"), pod["metadata"]["namespace"]
            names = [f"{host}.{sub}.{ns}.svc.cluster.local", f"{host}.{sub}.{ns}.svc", f"{host}.{sub}.{ns}",
                     f"{host}.{sub}"] if sub else []  # fmt: skip
            lines.append(f"{self._ip(pod)} " + " ".join(names + [host]))
        text = "\n".join(lines) + "\n"
        if self.hosts_file.read_text() != text:
            with open(self.hosts_file, "r+") as f:
                f.write(text)
                f.truncate()
