"""What every launcher offers: submit a job file, follow it through a handle, read its `result.json`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Literal, Protocol, runtime_checkable

from pydantic import ValidationError

from infra.launch.job import JobResult, JobSpec
from infra.store import open_store

JobState = Literal["pending", "running", "succeeded", "failed", "cancelled"]
RESULT_FILE = "result.json"


@runtime_checkable
class JobHandle(Protocol):
    """A submitted job. `wait` returns the exit code (0 = succeeded) and raises TimeoutError."""

    job_id: str
    log_path: Path

    def poll(self) -> JobState: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def cancel(self) -> None: ...

    def logs(self, follow: bool = False) -> Iterator[str]: ...


@runtime_checkable
class Launcher(Protocol):
    name: str

    def submit(self, spec: JobSpec, job_file: Path) -> JobHandle: ...

    def result(self, spec: JobSpec) -> JobResult | None: ...


def endpoint_for(spec: JobSpec) -> str | None:
    """The S3 endpoint a job's URIs live behind: the job's config first, then the environment."""
    infra = spec.config.get("infra") or {}
    return infra.get("s3_endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")


def read_result(spec: JobSpec) -> JobResult | None:
    """`result.json` from the job's output folder; None while the job has not written one."""
    store = open_store(spec.output, endpoint_url=endpoint_for(spec))
    try:
        raw = store.get_bytes(RESULT_FILE)
    except FileNotFoundError:
        return None
    except Exception as exc:  # S3 reports a missing key as ClientError/NoSuchKey
        if "NoSuchKey" in repr(exc) or "404" in str(exc) or "Not Found" in str(exc):
            return None
        raise
    where = f"{spec.output.rstrip('/')}/{RESULT_FILE}"
    try:
        return JobResult.model_validate(json.loads(raw))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ValueError(f"{where} is not a valid job result: {exc}") from None


def write_result(spec: JobSpec, result: JobResult) -> str:
    """What a job's rank 0 calls last; returns the URI written. The result names its job and attempt."""
    store = open_store(spec.output, endpoint_url=endpoint_for(spec))
    result = result.model_copy(update={"job_id": spec.job_id, "attempt": spec.attempt})
    store.put_bytes(result.model_dump_json(indent=2).encode(), RESULT_FILE)
    return f"{spec.output.rstrip('/')}/{RESULT_FILE}"


def follow_file(path: Path, stop, poll_s: float = 0.2) -> Iterator[str]:
    """Lines of a growing log file until `stop()` is true and the end is reached (tail -f)."""
    import time

    while not path.exists():
        if stop():
            return
        time.sleep(poll_s)
    with open(path, "r", errors="replace") as f:
        pending = ""
        while True:
            chunk = f.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
                continue
            if stop():
                rest = pending + f.read()
                yield from rest.splitlines(keepends=True)
                return
            time.sleep(poll_s)
