"""Where a job's inputs come from and its outputs go: local paths and file:// URIs are used in place;
any other URI (s3://) is downloaded into the job's workdir, and the output folder is staged there
and uploaded when the job ends."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from infra.store import open_uri


def is_local(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


def local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme else uri).expanduser().resolve()


def fetch_input(uri: str, workdir: str | Path, name: str, endpoint_url: str | None = None) -> Path:
    """A local folder holding the input `name` (downloaded into workdir/inputs/name if remote)."""
    if is_local(uri):
        path = local_path(uri)
        if not path.exists():
            raise FileNotFoundError(f"job input {name!r}: {uri} does not exist")
        return path
    store, key = open_uri(uri, endpoint_url)
    return store.get_dir(key, Path(workdir) / "inputs" / name)


class OutputFolder:
    """`path` is where to write; `publish()` uploads it when the output URI is remote."""

    def __init__(self, uri: str, workdir: str | Path, endpoint_url: str | None = None):
        self.uri, self.endpoint_url = uri, endpoint_url
        self.path = local_path(uri) if is_local(uri) else Path(workdir) / "output"
        self.path.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        if not is_local(self.uri):
            store, key = open_uri(self.uri, self.endpoint_url)
            store.put_dir(self.path, key)
