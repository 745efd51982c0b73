"""Object store: one interface, two backends (`file://` embedded default, `s3://` through boto3).

Keys are `/`-separated paths relative to the store root. `open_store(uri)` takes a store root URI;
`open_uri(uri)` splits any object/folder URI into (store, key).

Both backends make a write visible all at once (a temporary file renamed into place; an S3 PUT or a
completed multipart upload), so a reader never sees half an object, and both verify a download's
sha256 before the file appears at its destination.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

# Temporary files of in-flight writes end with this; listings skip them.
TMP_SUFFIX = ".eightfold-part"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def join_key(*parts: str) -> str:
    """Join key parts with single slashes, ignoring empty parts: join_key("", "a/", "/b") == "a/b"."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class StoreError(RuntimeError):
    pass


class ChecksumMismatch(StoreError):
    pass


def tmp_sibling(path: Path) -> Path:
    """A unique temporary name next to `path` (same filesystem, so os.replace is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def verify_sha256(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ChecksumMismatch(f"{what}: sha256 of the downloaded copy is {got}, expected {expected}")


class Store(ABC):
    """put/get of files and folders, list, exists, delete. Subclasses implement the file-level calls."""

    uri: str

    @abstractmethod
    def put_file(self, local: str | Path, key: str) -> None: ...

    @abstractmethod
    def get_file(self, key: str, local: str | Path, sha256: str | None = None) -> Path:
        """Download `key`; when `sha256` is given, verify it and raise ChecksumMismatch on a bad copy
        (nothing is left at `local` then). A missing key raises FileNotFoundError."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every object key equal to `prefix` or under the folder `prefix/` (recursive), sorted."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True for an object, or for a folder holding at least one object."""

    @abstractmethod
    def delete(self, prefix: str) -> int:
        """Delete one object or everything under a folder prefix; returns how many objects went."""

    @abstractmethod
    def put_bytes(self, data: bytes, key: str) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """An object's bytes and its version (an opaque token that changes with every write), or None
        when it is missing: what `put_if` compares against."""
        raise NotImplementedError

    def put_if(self, data: bytes, key: str, version: str | None) -> str | None:
        """A conditional write, atomic against every other writer of the store: with `version=None`
        only if `key` is missing, else only if its version is still `version`. Returns the new
        version, or None when the condition did not hold (nothing was written)."""
        raise NotImplementedError

    def object_info(self, key: str) -> dict:
        """`size` and `sha256` of one object (FileNotFoundError when it is missing). Lets a commit
        describe files a job wrote straight to the store without downloading them."""
        raise NotImplementedError

    def url(self, key: str) -> str:
        key = key.strip("/")
        return f"{self.uri.rstrip('/')}/{key}" if key else self.uri

    # --- folders ---------------------------------------------------------------------------------
    def put_dir(self, local: str | Path, prefix: str) -> list[str]:
        local = Path(local)
        if not local.is_dir():
            raise NotADirectoryError(f"put_dir: {local} is not a folder")
        keys = []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = join_key(prefix, path.relative_to(local).as_posix())
            self.put_file(path, key)
            keys.append(key)
        return keys

    def get_dir(self, prefix: str, local: str | Path) -> Path:
        local = Path(local)
        prefix = prefix.strip("/")
        keys = [k for k in self.list(prefix) if k != prefix]
        if not keys:
            raise FileNotFoundError(f"{self.url(prefix)} holds no objects")
        start = len(prefix) + 1 if prefix else 0
        for key in keys:
            self.get_file(key, local / key[start:])
        return local

    # --- JSON convenience ------------------------------------------------------------------------
    def put_json(self, obj: Any, key: str) -> None:
        self.put_bytes(json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), key)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_bytes(key))

    def iter_dirs(self, prefix: str) -> Iterator[str]:
        """Immediate sub-folder names under prefix (folders that hold at least one object)."""
        prefix = prefix.strip("/")
        start = len(prefix) + 1 if prefix else 0
        seen = set()
        for key in self.list(prefix):
            head = key[start:].split("/", 1)
            if len(head) == 2 and head[0] not in seen:
                seen.add(head[0])
                yield head[0]


class FileStore(Store):
    """A folder on the local filesystem (or a shared mount). Writes go to a temporary sibling that is
    fsynced and renamed into place, so a crash never leaves a partial object under its real name."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        p = (self.root / key.strip("/")).resolve()
        if p != self.root and self.root not in p.parents:
            raise StoreError(f"key {key!r} escapes the store root {self.root}")
        return p

    def _write_atomic(self, dst: Path, write) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_sibling(dst)
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put_file(self, local, key):
        local = Path(local)
        if not local.is_file():
            raise FileNotFoundError(f"put_file: local file {local} does not exist")
        dst = self._path(key)
        if dst == self.root:
            raise StoreError("put_file needs a non-empty key")

        def copy(f):
            with open(local, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)

        self._write_atomic(dst, copy)

    def get_file(self, key, local, sha256=None):
        src, local = self._path(key), Path(local)
        if not src.is_file():
            raise FileNotFoundError(f"{self.url(key)} does not exist")
        local.parent.mkdir(parents=True, exist_ok=True)
        if local.exists() and src.samefile(local):
            if sha256 is not None:
                verify_sha256(local, sha256, self.url(key))
            return local
        tmp = tmp_sibling(local)
        try:
            shutil.copyfile(src, tmp)
            if sha256 is not None:
                verify_sha256(tmp, sha256, self.url(key))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)
        return local

    def list(self, prefix=""):
        base = self._path(prefix)
        if base.is_file():
            return [prefix.strip("/")]
        if not base.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file() and not p.name.endswith(TMP_SUFFIX)
        )

    def exists(self, key):
        p = self._path(key)
        return p.is_file() or (p.is_dir() and any(q.is_file() for q in p.rglob("*")))

    def delete(self, prefix):
        p = self._path(prefix)
        if p.is_file():
            p.unlink()
            return 1
        if p.is_dir():
            n = sum(1 for q in p.rglob("*") if q.is_file() and not q.name.endswith(TMP_SUFFIX))
            if p == self.root:  # empty the store but keep its root folder
                for child in p.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
            else:
                shutil.rmtree(p)
            return n
        return 0

    def put_bytes(self, data, key):
        dst = self._path(key)
        if dst == self.root:
            raise StoreError("put_bytes needs a non-empty key")
        self._write_atomic(dst, lambda f: f.write(data))

    def get_bytes(self, key):
        p = self._path(key)
        if not p.is_file():
            raise FileNotFoundError(f"{self.url(key)} does not exist")
        return p.read_bytes()

    def iter_dirs(self, prefix):
        base = self._path(prefix)
        if not base.is_dir():
            return iter(())
        return iter(sorted(c.name for c in base.iterdir() if c.is_dir()))

    def object_info(self, key):
        p = self._path(key)
        if not p.is_file():
            raise FileNotFoundError(f"{self.url(key)} does not exist")
        return {"size": p.stat().st_size, "sha256": sha256_file(p)}

    def get_versioned(self, key):
        p = self._path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def put_if(self, data, key, version):
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        # compare and write under an exclusive lock every writer of this key takes (flock is honoured by
        # every process on the machine, and on NFS as a POSIX lock)
        with open(dst.with_name(dst.name + ".guard"), "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                current = self.get_versioned(key)
                if (current is None) != (version is None) or (current is not None and current[1] != version):
                    return None
                self._write_atomic(dst, lambda f: f.write(data))
                return hashlib.sha256(data).hexdigest()
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def local_path(self, key: str) -> Path:
        """file:// only: where an object lives on disk (lets local jobs skip a copy)."""
        return self._path(key)


def _file_uri_path(uri: str) -> str:
    """The filesystem path of `file:///abs`, `file://relative/dir` or a plain path."""
    parsed = urlparse(uri)
    if parsed.scheme == "":
        return uri
    # `file://rel/dir` puts "rel" in netloc; keep it as part of a relative path.
    if parsed.netloc and parsed.netloc != "localhost":
        return parsed.netloc + parsed.path
    return parsed.path


def open_store(uri: str, endpoint_url: str | None = None) -> Store:
    """A store from its root URI: `file:///abs/dir`, a plain path, or `s3://bucket/prefix`."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = _file_uri_path(uri)
        if not path:
            raise StoreError(f"store URI {uri!r} names no folder")
        return FileStore(path)
    if parsed.scheme == "s3":
        from infra.s3 import S3Store  # boto3 only when needed

        return S3Store(parsed.netloc, parsed.path.strip("/"), endpoint_url=endpoint_url)
    raise StoreError(f"unsupported store URI {uri!r}: use file:// or s3://")


def open_uri(uri: str, endpoint_url: str | None = None) -> tuple[Store, str]:
    """Split an object or folder URI into a store rooted at its parent and the last component's key.

    For s3 the store is the bucket and the key is the whole path; for file the store is the parent
    folder and the key the last path component.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return open_store(f"s3://{parsed.netloc}", endpoint_url), parsed.path.strip("/")
    if parsed.scheme not in ("", "file"):
        raise StoreError(f"unsupported URI {uri!r}: use file:// or s3://")
    path = Path(_file_uri_path(uri)).expanduser().resolve()
    return FileStore(path.parent), path.name
