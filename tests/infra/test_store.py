"""The object store: file:// and s3:// (moto over real HTTP) behave the same; multipart, checksums,
retries with backoff on injected transient failures, clear errors on permanent ones."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from fixtures.s3 import FAST_RETRY, FlakyProxy, new_bucket_name

from infra.s3 import S3Store
from infra.store import TMP_SUFFIX, ChecksumMismatch, FileStore, StoreError, open_store, open_uri, sha256_file

MB = 1 << 20


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore(tmp_path / "store")
    return request.getfixturevalue("s3_store")


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def corrupt_in_store(store, key: str) -> None:
    """Flip one byte of the stored object behind the store's back (keeping its sha256 metadata on S3,
    as bit rot would)."""
    if isinstance(store, FileStore):
        p = store.local_path(key)
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
        return
    full = store._key(key)
    obj = store.client.get_object(Bucket=store.bucket, Key=full)
    data = bytearray(obj["Body"].read())
    data[len(data) // 2] ^= 0xFF
    store.client.put_object(Bucket=store.bucket, Key=full, Body=bytes(data), Metadata=obj["Metadata"])


# --- round trips ---------------------------------------------------------------------------------

def test_file_round_trip(store, tmp_path):
    data = os.urandom(300_000)
    src = write(tmp_path / "src.bin", data)
    store.put_file(src, "a/b/src.bin")
    assert store.exists("a/b/src.bin") and store.exists("a/b") and store.exists("a")
    assert not store.exists("a/b/other.bin") and not store.exists("a/bc")

    out = store.get_file("a/b/src.bin", tmp_path / "out" / "copy.bin", sha256=hashlib.sha256(data).hexdigest())
    assert out.read_bytes() == data

    store.put_bytes(b"bytes!", "a/bc/x.txt")
    store.put_json({"k": [1, 2], "s": "v"}, "a/m.json")
    assert store.get_bytes("a/bc/x.txt") == b"bytes!"
    assert store.get_json("a/m.json") == {"k": [1, 2], "s": "v"}
    # a folder prefix never matches a sibling that merely shares its first letters
    assert store.list("a/b") == ["a/b/src.bin"]
    assert store.list("a") == ["a/b/src.bin", "a/bc/x.txt", "a/m.json"]
    assert store.list("a/m.json") == ["a/m.json"]
    assert store.list() == store.list("a") and store.list("zzz") == [] and store.exists("")
    assert sorted(store.iter_dirs("a")) == ["b", "bc"]
    assert store.url("a/m.json") == store.uri.rstrip("/") + "/a/m.json"

    # overwrite replaces the content
    store.put_bytes(b"second", "a/bc/x.txt")
    assert store.get_bytes("a/bc/x.txt") == b"second"

    assert store.delete("a/b") == 1
    assert store.list("a") == ["a/bc/x.txt", "a/m.json"]
    assert store.delete("nothing/here") == 0
    with pytest.raises(FileNotFoundError):
        store.get_bytes("a/b/src.bin")
    with pytest.raises(FileNotFoundError):
        store.get_file("a/b/src.bin", tmp_path / "never.bin")
    assert not (tmp_path / "never.bin").exists()


def test_dir_round_trip(store, tmp_path):
    src = tmp_path / "src"
    files = {"top.txt": b"top", "sub/one.bin": os.urandom(1000), "sub/deeper/two.bin": os.urandom(70_000), "empty.txt": b""}
    for name, data in files.items():
        write(src / name, data)
    keys = store.put_dir(src, "run/ckpt")
    assert sorted(keys) == sorted(f"run/ckpt/{n}" for n in files)
    assert list(store.iter_dirs("run/ckpt")) == ["sub"]

    got = store.get_dir("run/ckpt", tmp_path / "dst")
    assert tree(got) == files
    assert store.delete("run") == len(files)
    assert store.list() == [] and not store.exists("run/ckpt") and not store.exists("")
    with pytest.raises(FileNotFoundError, match="holds no objects"):
        store.get_dir("run/ckpt", tmp_path / "dst2")


def test_corrupted_download_is_caught_by_its_checksum(store, tmp_path):
    data = os.urandom(2 * MB)
    src = write(tmp_path / "w.bin", data)
    digest = sha256_file(src)
    store.put_file(src, "w/w.bin")
    corrupt_in_store(store, "w/w.bin")

    dst = tmp_path / "dl" / "w.bin"
    with pytest.raises(ChecksumMismatch, match=digest):
        store.get_file("w/w.bin", dst, sha256=digest)
    # a bad copy never appears under the destination name, and no temporary file is left behind
    assert not dst.exists() and list(dst.parent.iterdir()) == []
    # the corruption is real: without a checksum the file store hands the changed bytes back
    if isinstance(store, FileStore):
        assert store.get_file("w/w.bin", dst).read_bytes() != data


def test_s3_verifies_the_upload_sha256_without_a_manifest(s3_store, tmp_path):
    src = write(tmp_path / "m.bin", os.urandom(100_000))
    s3_store.put_file(src, "m.bin")
    assert s3_store.object_info("m.bin")["sha256"] == sha256_file(src)
    assert s3_store.get_file("m.bin", tmp_path / "ok.bin").read_bytes() == src.read_bytes()
    s3_store.put_bytes(b"abc" * 1000, "b.bin")
    corrupt_in_store(s3_store, "m.bin")
    corrupt_in_store(s3_store, "b.bin")
    with pytest.raises(ChecksumMismatch):
        s3_store.get_file("m.bin", tmp_path / "bad.bin")  # no sha256 given: the metadata's is used
    with pytest.raises(ChecksumMismatch):
        s3_store.get_bytes("b.bin")


def multipart_etag(path: Path, part_size: int) -> str:
    """S3's multipart ETag computed independently: md5 of the parts' md5 digests, then -N."""
    digests = []
    with open(path, "rb") as f:
        while block := f.read(part_size):
            digests.append(hashlib.md5(block).digest())
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def test_s3_50mb_object_goes_multipart(s3_store, tmp_path):
    src = write(tmp_path / "big.bin", os.urandom(50 * MB))
    digest = sha256_file(src)
    s3_store.put_file(src, "big/big.bin")
    info = s3_store.object_info("big/big.bin")
    assert info["size"] == 50 * MB
    # 8 MB parts: 7 of them, and the ETag S3 built from them matches one computed here
    assert info["etag"].endswith("-7")
    assert info["etag"] == multipart_etag(src, 8 * MB)
    out = s3_store.get_file("big/big.bin", tmp_path / "back.bin", sha256=digest)
    assert sha256_file(out) == digest


def test_s3_multipart_threshold_and_part_size_are_configurable(s3_endpoint, tmp_path):
    store = S3Store(new_bucket_name(), endpoint_url=s3_endpoint, multipart_threshold=5 * MB,
                    multipart_chunksize=5 * MB, **FAST_RETRY)
    small = write(tmp_path / "small.bin", os.urandom(4 * MB))
    big = write(tmp_path / "big.bin", os.urandom(12 * MB))
    store.put_file(small, "small.bin")
    store.put_file(big, "big.bin")
    assert "-" not in store.object_info("small.bin")["etag"]  # below the threshold: one PUT
    assert store.object_info("big.bin")["etag"] == multipart_etag(big, 5 * MB)  # 3 parts
    store.delete("")


# --- FileStore specifics ---------------------------------------------------------------------------

def test_file_store_write_is_atomic(tmp_path, monkeypatch):
    store = FileStore(tmp_path / "s")
    store.put_bytes(b"old", "k/v.bin")
    # an in-flight temporary file is never listed
    write(store.local_path("k") / f".v.bin.123-abc{TMP_SUFFIX}", b"partial")
    assert store.list() == ["k/v.bin"]

    def crash(*_a, **_k):
        raise OSError("disk vanished")

    monkeypatch.setattr("infra.store.os.replace", crash)
    with pytest.raises(OSError, match="disk vanished"):
        store.put_bytes(b"new", "k/v.bin")
    with pytest.raises(OSError):
        store.put_file(write(tmp_path / "n.bin", b"new"), "k/w.bin")
    monkeypatch.undo()
    # the old object is intact, the failed ones never appeared, their temporary files are gone
    assert store.get_bytes("k/v.bin") == b"old"
    assert store.list() == ["k/v.bin"]
    assert sorted(p.name for p in store.local_path("k").iterdir()) == [f".v.bin.123-abc{TMP_SUFFIX}", "v.bin"]


def test_file_store_rejects_keys_outside_its_root(tmp_path):
    store = FileStore(tmp_path / "s")
    with pytest.raises(StoreError, match="escapes"):
        store.put_bytes(b"x", "../outside.txt")
    assert not (tmp_path / "outside.txt").exists()


def test_open_store_and_open_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert isinstance(open_store(f"file://{tmp_path}/a"), FileStore)
    assert open_store("file://rel/dir").root == tmp_path / "rel" / "dir"  # netloc is not dropped
    assert open_store(str(tmp_path / "plain")).root == tmp_path / "plain"
    s3 = open_store("s3://my-bucket/some/prefix", endpoint_url="http://127.0.0.1:9")
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("my-bucket", "some/prefix")
    assert s3.url("x/y") == "s3://my-bucket/some/prefix/x/y"
    store, key = open_uri("s3://my-bucket/a/b/c.bin", endpoint_url="http://127.0.0.1:9")
    assert (store.bucket, store.prefix, key) == ("my-bucket", "", "a/b/c.bin")
    store, key = open_uri(f"file://{tmp_path}/d/e")
    assert (store.root, key) == (tmp_path / "d", "e")
    with pytest.raises(StoreError, match="gs://"):
        open_store("gs://bucket/x")
    with pytest.raises(StoreError, match="invalid S3 bucket name 'No_Such'"):
        open_store("s3://No_Such/x")


# --- S3 behaviour: buckets, paging, retries --------------------------------------------------------

def test_s3_bucket_created_when_missing_unless_disabled(s3_endpoint):
    name = new_bucket_name()
    strict = S3Store(name, endpoint_url=s3_endpoint, create_bucket=False, **FAST_RETRY)
    assert strict.list() == [] and not strict.exists("x")  # reading a missing bucket is just empty
    with pytest.raises(FileNotFoundError, match=f"bucket .{name}. does not exist"):
        strict.get_bytes("x")
    with pytest.raises(StoreError, match=f"bucket '{name}' does not exist"):
        strict.put_bytes(b"1", "x")
    store = S3Store(name, "pre", endpoint_url=s3_endpoint, **FAST_RETRY)
    store.put_bytes(b"1", "x")
    assert strict.list() == ["pre/x"] and store.list() == ["x"]
    store.delete("")


def test_s3_list_and_delete_page_through_many_keys(s3_endpoint, flaky_proxy):
    store = S3Store(new_bucket_name(), "p", endpoint_url=flaky_proxy.url, list_page_size=3, delete_batch=4,
                    **FAST_RETRY)
    keys = [f"d/{i:02d}" for i in range(10)]
    for k in keys:
        store.put_bytes(k.encode(), k)
    store.put_bytes(b"x", "dz")  # shares the prefix "d" but is not under the folder d/
    flaky_proxy.requests.clear()
    assert store.list("d") == keys
    list_calls = [p for m, p, _ in flaky_proxy.requests if m == "GET" and "list-type=2" in p]
    assert len(list_calls) == 4  # 11 keys under "p/d", 3 a page
    flaky_proxy.requests.clear()
    assert store.delete("d") == 10
    assert sum(1 for m, p, _ in flaky_proxy.requests if m == "POST" and "delete" in p) == 3  # 4 + 4 + 2
    assert store.list() == ["dz"]


def flaky_store(proxy: FlakyProxy, **kw) -> S3Store:
    return S3Store(new_bucket_name(), endpoint_url=proxy.url, **{**FAST_RETRY, **kw})


def test_s3_transient_errors_are_retried(flaky_proxy, tmp_path):
    store = flaky_store(flaky_proxy)
    src = write(tmp_path / "f.bin", os.urandom(200_000))
    store.put_file(src, "f.bin")  # creates the bucket

    flaky_proxy.requests.clear()
    flaky_proxy.plan = lambda method, path, n: {1: 503, 2: 500}.get(n)
    store.put_file(src, "g.bin")
    assert flaky_proxy.outcomes() == [503, 500, "ok"]  # two failures, then the third attempt lands

    flaky_proxy.requests.clear()
    flaky_proxy.plan = lambda method, path, n: "drop" if n == 1 else None  # connection closed mid-request
    out = store.get_file("g.bin", tmp_path / "g.bin", sha256=sha256_file(src))
    assert out.read_bytes() == src.read_bytes()
    assert flaky_proxy.outcomes()[0] == "drop" and flaky_proxy.outcomes()[-1] == "ok"

    flaky_proxy.requests.clear()
    flaky_proxy.plan = lambda method, path, n: 503 if n <= 2 else None
    assert store.list() == ["f.bin", "g.bin"]
    assert flaky_proxy.outcomes() == [503, 503, "ok"]


def test_s3_multipart_part_failure_is_retried(flaky_proxy, tmp_path):
    store = flaky_store(flaky_proxy, multipart_threshold=5 * MB, multipart_chunksize=5 * MB, max_concurrency=1)
    store.ensure_bucket()
    src = write(tmp_path / "mp.bin", os.urandom(11 * MB))
    failed = []

    def plan(method, path, n):
        if method == "PUT" and "partNumber=2" in path and not failed:
            failed.append(path)
            return 503
        return None

    flaky_proxy.plan = plan
    store.put_file(src, "mp.bin")
    assert failed, "the fault was never injected"
    assert store.object_info("mp.bin")["etag"] == multipart_etag(src, 5 * MB)
    assert sha256_file(store.get_file("mp.bin", tmp_path / "back.bin")) == sha256_file(src)


def test_botocore_retries_are_configured_too(flaky_proxy):
    # our own retry loop off (1 attempt): botocore's standard-mode retry alone absorbs two 503s
    store = flaky_store(flaky_proxy, attempts=1, botocore_attempts=3)
    store.ensure_bucket()
    flaky_proxy.requests.clear()
    flaky_proxy.plan = lambda method, path, n: 503 if n <= 2 else None
    store.put_bytes(b"payload", "k")
    assert flaky_proxy.outcomes() == [503, 503, "ok"]
    assert store.get_bytes("k") == b"payload"


def test_s3_permanent_failure_raises_after_n_attempts(flaky_proxy, tmp_path):
    store = flaky_store(flaky_proxy, attempts=4)
    store.put_bytes(b"v", "k")
    flaky_proxy.requests.clear()
    flaky_proxy.plan = lambda method, path, n: 500
    with pytest.raises(StoreError, match=r"get s3://.*/k failed after 4 attempt\(s\)") as info:
        store.get_bytes("k")
    assert "InternalError" in str(info.value)
    assert flaky_proxy.outcomes() == [500] * 4


def test_s3_unreachable_endpoint_is_a_clear_error():
    # a port nobody listens on: connection refused on every attempt
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3Store("some-bucket", endpoint_url=f"http://127.0.0.1:{port}", **FAST_RETRY)
    with pytest.raises(StoreError, match=r"failed after 3 attempt\(s\).*Could not connect"):
        store.get_bytes("k")


def test_s3_missing_key_is_not_retried(flaky_proxy, tmp_path):
    store = flaky_store(flaky_proxy)
    store.ensure_bucket()
    flaky_proxy.requests.clear()
    with pytest.raises(FileNotFoundError, match="nope.bin does not exist"):
        store.get_file("nope.bin", tmp_path / "nope.bin")
    assert len(flaky_proxy.requests) == 1
