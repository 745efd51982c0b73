"""The `s3://` store: boto3 against any S3 endpoint (AWS, MinIO, a local test server).

- Endpoint: the `endpoint_url` argument, else `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, else AWS.
  Region: the argument, else `AWS_REGION` / `AWS_DEFAULT_REGION`, else us-east-1. Credentials come
  from boto3's usual chain (env, profile, instance role).
- Large files go up and down in parts (boto3's TransferConfig; multipart from `multipart_threshold`).
- Every upload stores the file's sha256 as object metadata (`x-amz-meta-sha256`); a download is
  verified against the sha256 the caller gives (the artifact manifest's), else against that metadata,
  before the file appears at its destination.
- Transient failures (HTTP 5xx, throttling, dropped or refused connections, timeouts) are retried
  twice over: botocore's own retry of single requests (`botocore_attempts`), and around each whole
  operation by `_call` with exponential backoff and jitter (`attempts`, `backoff_s`, `max_backoff_s`),
  which also covers a multipart transfer failing half way. When the attempts are spent, StoreError
  names the operation, the URI, the attempt count and the last error. Permanent errors (missing key,
  access denied) are not retried.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)

from infra.store import ChecksumMismatch, Store, StoreError, join_key, sha256_file, tmp_sibling, verify_sha256

log = logging.getLogger(__name__)

MB = 1 << 20
SHA256_META = "sha256"  # object metadata key holding the content's sha256 (x-amz-meta-sha256)
DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes

# S3 error codes that mean "try again later" even when the status is not 5xx.
_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
    "RequestTimeout", "RequestTimeoutException", "RequestLimitExceeded", "PriorRequestNotComplete",
}
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_DENIED_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"}
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

T = TypeVar("T")


def _chain(exc: BaseException):
    """The exception and what it wraps (boto3 re-raises a ClientError as S3UploadFailedError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _client_error(exc: BaseException) -> ClientError | None:
    return next((e for e in _chain(exc) if isinstance(e, ClientError)), None)


def _error_code(err: ClientError) -> tuple[str, int]:
    return str(err.response.get("Error", {}).get("Code", "")), int(
        err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    )


def is_transient(exc: BaseException) -> bool:
    """Worth another attempt: a 5xx or throttling answer, or the connection failing on the way."""
    for e in _chain(exc):
        if isinstance(e, ClientError):
            code, status = _error_code(e)
            return status >= 500 or code in _TRANSIENT_CODES or (code.isdigit() and int(code) >= 500)
        if isinstance(e, (HTTPClientError, BotoConnectionError, ResponseStreamingError)):
            return True  # refused/closed connections, read/connect timeouts, broken streams
    return False


class S3Store(Store):
    """A bucket (optionally under a key prefix) as a Store. Thread-safe: boto3 clients are."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        *,
        region: str | None = None,
        create_bucket: bool = True,
        multipart_threshold: int = 8 * MB,
        multipart_chunksize: int = 8 * MB,
        max_concurrency: int = 4,
        attempts: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        botocore_attempts: int = 3,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        list_page_size: int = 1000,
        delete_batch: int = DELETE_BATCH,
    ):
        if not _BUCKET_NAME.match(bucket or ""):
            raise StoreError(
                f"invalid S3 bucket name {bucket!r}: 3-63 characters of lowercase letters, digits, '.' and '-', "
                "starting and ending with a letter or digit"
            )
        if attempts < 1 or botocore_attempts < 1:
            raise StoreError(f"attempts and botocore_attempts must be >= 1, got {attempts} and {botocore_attempts}")
        if not 1 <= delete_batch <= DELETE_BATCH or not 1 <= list_page_size <= 1000:
            raise StoreError(f"delete_batch and list_page_size must be in 1..1000, got {delete_batch}, {list_page_size}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        self.region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.create_bucket = create_bucket
        self.attempts, self.backoff_s, self.max_backoff_s = attempts, backoff_s, max_backoff_s
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        config = Config(
            region_name=self.region,
            retries={"total_max_attempts": botocore_attempts, "mode": "standard"},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max(10, 2 * max_concurrency),
            # Path-style URLs work with every S3-compatible server (MinIO, moto) without wildcard DNS.
            s3={"addressing_style": "path" if self.endpoint_url else "auto"},
            # We verify content with our own sha256; the newer default CRC trailers break older
            # S3-compatible servers, so send checksums only where the API requires them.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # A session per store: boto3's default session is not thread-safe to create clients from.
        self.client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, config=config)
        self.transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
        )
        self.list_page_size, self.delete_batch = list_page_size, delete_batch
        self._bucket_ready = False

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint_url={self.endpoint_url!r})"

    # --- plumbing --------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1:] if self.prefix else full_key

    def _call(self, what: str, uri: str, fn: Callable[[], T]) -> T:
        """Run one store operation, retrying transient failures with exponential backoff + jitter."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except (ClientError, BotoCoreError, Boto3Error) as exc:
                if not is_transient(exc):
                    raise self._permanent(what, uri, exc) from exc
                if attempt == self.attempts:
                    raise StoreError(f"{what} {uri} failed after {attempt} attempt(s): {exc}") from exc
                # Full backoff doubles each attempt; jitter keeps many ranks from retrying in step.
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                log.warning("%s %s: transient error (attempt %d/%d), retrying in %.2fs: %s",
                            what, uri, attempt, self.attempts, delay, exc)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _permanent(self, what: str, uri: str, exc: BaseException) -> Exception:
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(f"{what} {uri}: no usable AWS credentials (set AWS_ACCESS_KEY_ID and "
                              f"AWS_SECRET_ACCESS_KEY or a profile): {exc}")
        err = _client_error(exc)
        if err is not None:
            code, status = _error_code(err)
            if code == "NoSuchBucket":
                return FileNotFoundError(f"{uri}: bucket {self.bucket!r} does not exist at {self._where()}")
            if code in _NOT_FOUND_CODES or status == 404:
                return FileNotFoundError(f"{uri} does not exist")
            if code in _DENIED_CODES or status == 403:
                return StoreError(f"{what} {uri}: access denied by {self._where()} ({code}); check the credentials")
        return StoreError(f"{what} {uri}: {exc}")

    def _where(self) -> str:
        return self.endpoint_url or f"AWS S3 ({self.region})"

    def ensure_bucket(self) -> None:
        """Create the bucket when it is missing (if `create_bucket`), once per store object."""
        if self._bucket_ready:
            return
        uri = f"s3://{self.bucket}"
        try:
            self._call("head bucket", uri, lambda: self.client.head_bucket(Bucket=self.bucket))
        except FileNotFoundError:
            if not self.create_bucket:
                raise StoreError(f"bucket {self.bucket!r} does not exist at {self._where()} "
                                 "(create it, or allow create_bucket)") from None
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.region != "us-east-1":  # us-east-1 rejects an explicit LocationConstraint
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}

            def create():
                try:
                    self.client.create_bucket(**kwargs)
                except ClientError as err:  # someone else created it first: fine
                    if _error_code(err)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise

            self._call("create bucket", uri, create)
            log.info("created bucket %s at %s", self.bucket, self._where())
        self._bucket_ready = True

    def _head(self, key: str) -> dict:
        full = self._key(key)
        return self._call("head", self.url(key), lambda: self.client.head_object(Bucket=self.bucket, Key=full))

    # --- objects ---------------------------------------------------------------------------------
    def put_file(self, local, key):
        local = Path(local)
        if not local.is_file():
            raise FileNotFoundError(f"put_file: local file {local} does not exist")
        full = self._key(key)
        if not full:
            raise StoreError("put_file needs a non-empty key")
        self.ensure_bucket()
        extra = {"Metadata": {SHA256_META: sha256_file(local)}}
        self._call("upload", self.url(key), lambda: self.client.upload_file(
            str(local), self.bucket, full, ExtraArgs=extra, Config=self.transfer_config))

    def get_file(self, key, local, sha256=None):
        local = Path(local)
        full = self._key(key)
        if sha256 is None:  # no manifest to check against: use the sha256 recorded at upload
            sha256 = self._head(key).get("Metadata", {}).get(SHA256_META)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_sibling(local)
        try:
            self._call("download", self.url(key), lambda: self.client.download_file(
                self.bucket, full, str(tmp), Config=self.transfer_config))
            if sha256:
                verify_sha256(tmp, sha256, self.url(key))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)
        return local

    def put_bytes(self, data, key):
        full = self._key(key)
        if not full:
            raise StoreError("put_bytes needs a non-empty key")
        self.ensure_bucket()
        meta = {SHA256_META: hashlib.sha256(data).hexdigest()}
        self._call("put", self.url(key), lambda: self.client.put_object(
            Bucket=self.bucket, Key=full, Body=data, Metadata=meta))

    def get_bytes(self, key):
        full = self._key(key)

        def fetch():
            resp = self.client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read(), resp.get("Metadata", {}).get(SHA256_META)

        data, expected = self._call("get", self.url(key), fetch)
        if expected and (got := hashlib.sha256(data).hexdigest()) != expected:
            raise ChecksumMismatch(f"{self.url(key)}: sha256 of the downloaded bytes is {got}, expected {expected}")
        return data

    def get_versioned(self, key):
        full = self._key(key)

        def fetch():
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=full)
            except ClientError as exc:
                if _error_code(exc)[0] in _NOT_FOUND_CODES:  # no bucket yet: no object either
                    return None
                raise
            return resp["Body"].read(), str(resp["ETag"])

        return self._call("get", self.url(key), fetch)

    def put_if(self, data, key, version):
        """S3's conditional writes: If-None-Match: * to create, If-Match: ETAG to replace (AWS S3 since
        2024, MinIO). A 412, or a 409 from a concurrent conditional write, is the condition failing."""
        full = self._key(key)
        if not full:
            raise StoreError("put_if needs a non-empty key")
        self.ensure_bucket()
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}

        def put():
            try:
                resp = self.client.put_object(Bucket=self.bucket, Key=full, Body=data, **condition)
            except ClientError as exc:
                code, status = _error_code(exc)
                if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return None
                raise
            return str(resp["ETag"])

        return self._call("put", self.url(key), put)

    def object_info(self, key: str) -> dict:
        """size, etag, sha256 (from metadata) and last_modified of one object."""
        head = self._head(key)
        return {
            "size": int(head.get("ContentLength", 0)),
            "etag": str(head.get("ETag", "")).strip('"'),
            "sha256": head.get("Metadata", {}).get(SHA256_META),
            "last_modified": head.get("LastModified"),
        }

    # --- listing and deletion --------------------------------------------------------------------
    def _list_full(self, prefix: str) -> list[str]:
        """Full keys equal to `prefix` or under `prefix/` (not siblings that merely share a prefix)."""
        full = self._key(prefix)
        wanted = full + "/" if full else ""

        def scan():
            out = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full, PaginationConfig={"PageSize": self.list_page_size})
            for page in pages:
                out.extend(o["Key"] for o in page.get("Contents", []))
            return out

        try:
            keys = self._call("list", self.url(prefix), scan)
        except FileNotFoundError:  # no bucket yet: nothing in it
            return []
        return sorted(k for k in keys if not full or k == full or k.startswith(wanted))

    def list(self, prefix=""):
        return [self._rel(k) for k in self._list_full(prefix)]

    def iter_dirs(self, prefix):
        full = self._key(prefix)
        base = full + "/" if full else ""

        def scan():
            names = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/", PaginationConfig={"PageSize": self.list_page_size})
            for page in pages:
                names.extend(p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", []))
            return names

        try:
            return iter(sorted(self._call("list", self.url(prefix), scan)))
        except FileNotFoundError:
            return iter(())

    def exists(self, key):
        full = self._key(key)
        if full:
            try:
                self._head(key)
                return True
            except FileNotFoundError:
                pass

        def any_under():
            resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=(full + "/") if full else "", MaxKeys=1)
            return resp.get("KeyCount", 0) > 0

        try:
            return self._call("list", self.url(key), any_under)
        except FileNotFoundError:
            return False

    def delete(self, prefix):
        keys = self._list_full(prefix)
        for i in range(0, len(keys), self.delete_batch):
            batch = [{"Key": k} for k in keys[i:i + self.delete_batch]]
            resp = self._call("delete", self.url(prefix), lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            if errors := resp.get("Errors"):
                first = errors[0]
                raise StoreError(f"delete {self.url(prefix)}: {len(errors)} object(s) not deleted, e.g. "
                                 f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}")
        return len(keys)
