"""Start the stand-in cluster (API server, controllers, one node or more) and write its kubeconfig.

In a test: `with StandinCluster(tmp) as cluster: ... cluster.kubeconfig ...`. From a shell (what
start.sh runs): `python -m infra.k8s.cluster --root DIR [--port P]` serves until SIGTERM and writes
DIR/kubeconfig once the node is ready."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

import yaml

from infra.k8s.apiserver import ApiServer
from infra.k8s.controllers import ControllerManager
from infra.k8s.node import NodeAgent


def write_kubeconfig(path: Path, server: str, namespace: str = "default") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "eightfold-standin",
        "clusters": [{"name": "eightfold-standin", "cluster": {"server": server}}],
        "users": [{"name": "eightfold-standin", "user": {"token": "stand-in-accepts-any-token"}}],
        "contexts": [{"name": "eightfold-standin",
                      "context": {"cluster": "eightfold-standin", "user": "eightfold-standin", "namespace": namespace}}],
    }, sort_keys=False))  # fmt: skip
    return path


class StandinCluster:
    def __init__(self, root: Path, port: int = 0, period_s: float = 0.2, image_env: dict[str, str] | None = None,
                 nodes: int = 1):  # fmt: skip
        self.root = Path(root)
        self.apiserver = ApiServer(self.root / "node" / "logs", port=port)
        self.controllers = ControllerManager(self.apiserver.url, period_s)
        # Node i keeps its state in node/ (i = 0) or node-i/; each runs its own pods.
        self.nodes = [
            NodeAgent(self.apiserver.url, self.root / ("node" if i == 0 else f"node-{i}"), name=f"standin-node-{i}",
                      image_env=image_env, period_s=period_s, log_root=self.apiserver.log_root)
            for i in range(nodes)
        ]  # fmt: skip
        self.node = self.nodes[0]
        self.kubeconfig = self.root / "kubeconfig"
        self._serve = threading.Thread(target=self.apiserver.serve_forever, name="k8s-apiserver", daemon=True)

    @property
    def url(self) -> str:
        return self.apiserver.url

    def start(self) -> "StandinCluster":
        self._serve.start()
        for node in self.nodes:
            node.start()
        self.controllers.start()
        write_kubeconfig(self.kubeconfig, self.url)
        return self

    def stop(self) -> None:
        self.controllers.stop()
        for node in self.nodes:
            node.stop()
        self.apiserver.shutdown()
        self.apiserver.server_close()

    def __enter__(self) -> "StandinCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path, help="state folder: kubeconfig, node/, logs")
    parser.add_argument("--port", type=int, default=0, help="API server port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--nodes", type=int, default=1, help="how many nodes (standin-node-0, -1, ...)")
    args = parser.parse_args(argv)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    cluster = StandinCluster(args.root, port=args.port, nodes=args.nodes).start()
    print(f"stand-in Kubernetes API at {cluster.url}; kubeconfig {cluster.kubeconfig}", flush=True)
    done.wait()
    cluster.stop()


if __name__ == "__main__":
    main()
