"""Where a job's inputs come from and its outputs go, with nothing that needs a path another node sees.

- Workdir: every path a rank writes for itself (input cache, checkpoint staging, heartbeats, the
  staged output) is under the job's workdir, which `JobSpec.on_this_node` makes the node's own folder
  when the launcher gives each node one (the local launcher's simulated nodes, Slurm's node scratch).
- Inputs: local paths and file:// URIs are read in place (a shared filesystem is a file:// store);
  any other URI (s3://) is downloaded once per node into `{workdir}/cache/`, every file checked
  against its sha256 (the store's, recorded at upload), under a lock so a node's ranks download it
  once; a file already there with the right sha256 is kept, so a restart on the same node skips it.
- Output: file:// outputs are written in place. A remote output is staged in `{workdir}/output`:
  whole files (model.safetensors) go up when the job ends, and the append-only metrics.jsonl goes up
  every `sync_every_s` too, after being seeded from the store's copy at start, so a job resumed on
  another node continues the same file. Checkpoints and result.json go straight to the store
  (trainer.checkpoint, infra.launch.base.write_result).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from urllib.parse import urlparse

from infra.store import join_key, open_store, open_uri, sha256_file

METRICS = "metrics.jsonl"


def is_local(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


def local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme else uri).expanduser().resolve()


def fetch_input(uri: str, workdir: str | Path, name: str, endpoint_url: str | None = None) -> Path:
    """A local folder holding the input `name`: in place when local, else this node's verified cache."""
    if is_local(uri):
        path = local_path(uri)
        if not path.exists():
            raise FileNotFoundError(f"job input {name!r}: {uri} does not exist")
        return path
    from filelock import FileLock

    store, key = open_uri(uri, endpoint_url)
    cache = Path(workdir) / "cache" / f"{name}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        keys = [k for k in store.list(key) if k != key]
        if not keys:
            raise FileNotFoundError(f"job input {name!r}: {uri} holds no objects")
        for k in keys:
            dst = cache / k[len(key) + 1:]
            expected = store.object_info(k).get("sha256")
            if expected and dst.is_file() and sha256_file(dst) == expected:
                continue  # cached by an earlier attempt on this node
            store.get_file(k, dst, sha256=expected)  # ChecksumMismatch on a bad copy; nothing left at dst
    return cache


class OutputFolder:
    """`path` is where to write; `sync()` mirrors metrics.jsonl to a remote output (throttled), and
    `publish()` uploads everything staged when the job ends."""

    def __init__(self, uri: str, workdir: str | Path, endpoint_url: str | None = None, sync_every_s: float = 10.0,
                 writer: bool = True):
        """`writer`: the rank that writes the output (rank 0); other ranks only get `path`."""
        self.uri, self.endpoint_url = uri, endpoint_url
        self.remote = not is_local(uri)
        self.path = Path(workdir) / "output" if self.remote else local_path(uri)
        self.path.mkdir(parents=True, exist_ok=True)
        self.sync_every_s = sync_every_s
        self._synced_at = float("-inf")  # the first sync goes up at once
        self._store = open_store(uri, endpoint_url=endpoint_url) if self.remote and writer else None
        if self._store is not None:
            # the store's metrics.jsonl is the job's; a stale local copy from another attempt is not
            local = self.path / METRICS
            local.unlink(missing_ok=True)
            if self._store.exists(METRICS):
                self._store.get_file(METRICS, local)

    def sync(self, force: bool = False) -> None:
        if self._store is None or not (self.path / METRICS).is_file():
            return
        if force or time.monotonic() - self._synced_at >= self.sync_every_s:
            self._store.put_file(self.path / METRICS, METRICS)
            self._synced_at = time.monotonic()

    def publish(self) -> None:
        if self._store is not None:
            for path in sorted(p for p in self.path.rglob("*") if p.is_file()):
                self._store.put_file(path, join_key(path.relative_to(self.path).as_posix()))
