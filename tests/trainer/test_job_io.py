"""A job's inputs and outputs on a node that shares no path with the others (trainer/job_io.py): remote
inputs land in the node's own cache, checked against the store's sha256; metrics.jsonl of a remote
output is mirrored to the store while the job runs and picked up by the next attempt on another node."""

from __future__ import annotations

import pytest

from fixtures.s3 import s3_endpoint, s3_store  # noqa: F401
from infra.store import ChecksumMismatch
from infra.launch.job import NODE_DIR_ENV, JobSpec
from trainer.job_io import OutputFolder, fetch_input


def _node_workdir(monkeypatch, node_dir) -> str:
    """The job's workdir as a rank on that node sees it (JobSpec.on_this_node under the local launcher)."""
    monkeypatch.setenv(NODE_DIR_ENV, str(node_dir))
    spec = JobSpec(job_id="j", stage="pretrain", config={}, output="unused", workdir="/orchestrator/jobs/j")
    return spec.on_this_node().workdir


def test_remote_input_is_cached_per_node_and_checked(s3_store, tmp_path, monkeypatch):
    s3_store.put_bytes(b"a" * 1000, "tokens/train/shard-0.bin")
    s3_store.put_bytes(b"{}", "tokens/train/index.json")
    uri = s3_store.url("tokens")
    work = _node_workdir(monkeypatch, tmp_path / "node0")
    got = fetch_input(uri, work, "tokens", s3_store.endpoint_url)
    assert got.is_relative_to(tmp_path / "node0" / "cache")  # the node's own folder
    assert (got / "train" / "shard-0.bin").read_bytes() == b"a" * 1000

    # A second attempt on the node keeps a good copy, and replaces a corrupted one
    (got / "train" / "index.json").write_bytes(b"[]")
    mtime = (got / "train" / "shard-0.bin").stat().st_mtime_ns
    assert fetch_input(uri, work, "tokens", s3_store.endpoint_url) == got
    assert (got / "train" / "shard-0.bin").stat().st_mtime_ns == mtime
    assert (got / "train" / "index.json").read_bytes() == b"{}"

    # Another node has its own cache
    other = _node_workdir(monkeypatch, tmp_path / "node1")
    assert fetch_input(uri, other, "tokens", s3_store.endpoint_url).is_relative_to(tmp_path / "node1")


def test_a_download_that_does_not_match_the_stores_sha256_is_refused(s3_store, tmp_path, monkeypatch):
    s3_store.put_bytes(b"good", "tokens/train/shard-0.bin")
    # the object changes behind the sha256 recorded at upload (bit rot, a partial overwrite)
    key = s3_store._key("tokens/train/shard-0.bin")
    s3_store.client.copy_object(Bucket=s3_store.bucket, Key=key, CopySource={"Bucket": s3_store.bucket, "Key": key},
                                Metadata={"sha256": "0" * 64}, MetadataDirective="REPLACE")
    with pytest.raises(ChecksumMismatch, match="shard-0.bin"):
        fetch_input(s3_store.url("tokens"), _node_workdir(monkeypatch, tmp_path / "node0"), "tokens",
                    s3_store.endpoint_url)
    assert not list((tmp_path / "node0" / "cache").rglob("shard-0.bin"))


def test_local_input_is_read_in_place(tmp_path):
    (tmp_path / "tokens" / "train").mkdir(parents=True)
    assert fetch_input(str(tmp_path / "tokens"), tmp_path / "work", "tokens") == (tmp_path / "tokens").resolve()
    with pytest.raises(FileNotFoundError, match="'tokens'"):
        fetch_input(str(tmp_path / "missing"), tmp_path / "work", "tokens")


def test_metrics_of_a_remote_output_follow_the_job_across_nodes(s3_store, tmp_path, monkeypatch):
    uri = s3_store.url("runs/pretrain")
    first = OutputFolder(uri, _node_workdir(monkeypatch, tmp_path / "node0"), s3_store.endpoint_url, sync_every_s=3600)
    assert first.path == tmp_path / "node0" / "output"
    (first.path / "metrics.jsonl").write_text('{"step": 1}\n')
    first.sync()  # the first sync goes up at once
    (first.path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    first.sync()  # throttled: not yet
    assert s3_store.get_bytes("runs/pretrain/metrics.jsonl") == b'{"step": 1}\n'
    first.sync(force=True)
    assert s3_store.get_bytes("runs/pretrain/metrics.jsonl").count(b"\n") == 2

    # the next attempt runs on another node: it continues the store's file
    second = OutputFolder(uri, _node_workdir(monkeypatch, tmp_path / "node1"), s3_store.endpoint_url)
    assert (second.path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    # only the writing rank seeds and uploads
    reader = OutputFolder(uri, _node_workdir(monkeypatch, tmp_path / "node2"), s3_store.endpoint_url, writer=False)
    assert not (reader.path / "metrics.jsonl").exists()
    reader.publish()
