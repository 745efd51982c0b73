"""Object store: one interface, two backends (`file://` embedded default, `s3://` through boto3).

Keys are `/`-separated paths relative to the store root. `open_store(uri)` takes a store root URI;
`open_uri(uri)` splits any object/folder URI into (store, key).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class StoreError(RuntimeError):
    pass


class ChecksumMismatch(StoreError):
    pass


class Store(ABC):
    """put/get of files and folders, list, exists, delete. Subclasses implement the file-level calls."""

    uri: str

    @abstractmethod
    def put_file(self, local: str | Path, key: str) -> None: ...

    @abstractmethod
    def get_file(self, key: str, local: str | Path, sha256: str | None = None) -> Path:
        """Download `key`; when `sha256` is given, verify it and raise ChecksumMismatch on a bad copy."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix` (recursive), sorted."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, prefix: str) -> int:
        """Delete one object or everything under a folder prefix; returns how many objects went."""

    @abstractmethod
    def put_bytes(self, data: bytes, key: str) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    def url(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key.lstrip('/')}"

    # --- folders ---------------------------------------------------------------------------------
    def put_dir(self, local: str | Path, prefix: str) -> list[str]:
        local = Path(local)
        keys = []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = f"{prefix.rstrip('/')}/{path.relative_to(local).as_posix()}"
            self.put_file(path, key)
            keys.append(key)
        return keys

    def get_dir(self, prefix: str, local: str | Path) -> Path:
        local = Path(local)
        prefix = prefix.rstrip("/") + "/"
        for key in self.list(prefix):
            self.get_file(key, local / key[len(prefix):])
        return local

    # --- JSON convenience ------------------------------------------------------------------------
    def put_json(self, obj: Any, key: str) -> None:
        self.put_bytes(json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), key)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_bytes(key))

    def iter_dirs(self, prefix: str) -> Iterator[str]:
        """Immediate sub-folder names under prefix."""
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        seen = set()
        for key in self.list(prefix):
            head = key[len(prefix):].split("/", 1)
            if len(head) == 2 and head[0] not in seen:
                seen.add(head[0])
                yield head[0]


class FileStore(Store):
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        p = (self.root / key.lstrip("/")).resolve()
        if p != self.root and self.root not in p.parents:
            raise StoreError(f"key {key!r} escapes the store root {self.root}")
        return p

    def put_file(self, local, key):
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        shutil.copyfile(local, tmp)
        os.replace(tmp, dst)  # atomic: readers never see half a file

    def get_file(self, key, local, sha256=None):
        src, local = self._path(key), Path(local)
        if not src.is_file():
            raise FileNotFoundError(f"{self.url(key)} does not exist")
        local.parent.mkdir(parents=True, exist_ok=True)
        if src != local.resolve():
            shutil.copyfile(src, local)
        if sha256 is not None and (got := sha256_file(local)) != sha256:
            raise ChecksumMismatch(f"{self.url(key)}: sha256 {got} != expected {sha256}")
        return local

    def list(self, prefix=""):
        base = self._path(prefix) if prefix else self.root
        if base.is_file():
            return [prefix]
        if not base.exists():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file() and not p.name.endswith(".part"))

    def exists(self, key):
        return self._path(key).exists()

    def delete(self, prefix):
        p = self._path(prefix)
        if p.is_file():
            p.unlink()
            return 1
        if p.is_dir():
            n = sum(1 for q in p.rglob("*") if q.is_file())
            shutil.rmtree(p)
            return n
        return 0

    def put_bytes(self, data, key):
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, dst)

    def get_bytes(self, key):
        p = self._path(key)
        if not p.is_file():
            raise FileNotFoundError(f"{self.url(key)} does not exist")
        return p.read_bytes()

    def local_path(self, key: str) -> Path:
        """file:// only: where an object lives on disk (lets local jobs skip a copy)."""
        return self._path(key)


def open_store(uri: str, endpoint_url: str | None = None) -> Store:
    """A store from its root URI: `file:///abs/dir`, a plain path, or `s3://bucket/prefix`."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return FileStore(parsed.path if parsed.scheme else uri)
    if parsed.scheme == "s3":
        from infra.s3 import S3Store  # boto3 only when needed

        return S3Store(parsed.netloc, parsed.path.lstrip("/"), endpoint_url=endpoint_url)
    raise StoreError(f"unsupported store URI {uri!r}: use file:// or s3://")


def open_uri(uri: str, endpoint_url: str | None = None) -> tuple[Store, str]:
    """Split an object or folder URI into a store rooted at its parent and the last component's key.

    For s3 the store is the bucket; for file the root directory `/`-anchored parent.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return open_store(f"s3://{parsed.netloc}", endpoint_url), parsed.path.lstrip("/")
    path = Path(parsed.path if parsed.scheme else uri).expanduser().resolve()
    return FileStore(path.parent), path.name
