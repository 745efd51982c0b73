"""Health per node, without a cluster: a node's report goes to the job's output store (file:// and
S3), a failed or missing report names the node, the fault hook fails the node it names, and the
trainer's own pre-flight reports to the same place; a multi-node job works in the node's scratch dir."""

from __future__ import annotations

import pytest
import torch

from fixtures.trainer_data import tiny_config
from infra.health import node_name, read_bad_nodes_from_store, read_node_reports, write_node_report
from infra.launch.base import read_result
from infra.launch.job import JobSpec
from infra.node_health import FAULT_ENV, NODE_HEALTH_EXIT, bad_nodes_of, check_node, verdict
from infra.store import open_store
from trainer.health import PreflightFailed, preflight


def test_reports_in_the_store_name_bad_nodes_and_a_later_pass_clears_one(tmp_path, s3_store, s3_endpoint):
    for uri, endpoint in ((f"file://{tmp_path / 'out'}", None), (s3_store.url("job/out"), s3_endpoint)):
        store = open_store(uri, endpoint)
        assert read_bad_nodes_from_store(uri, endpoint) == {}  # nothing written yet
        write_node_report(store, "gpu-1", True, "")
        write_node_report(store, "gpu-2", False, "matmul: 12% of peak")
        assert read_bad_nodes_from_store(uri, endpoint) == {"gpu-2": "matmul: 12% of peak"}, uri
        write_node_report(store, "gpu-2", True, "")  # healthy again on a later probe
        assert read_bad_nodes_from_store(uri, endpoint) == {}, uri
        assert sorted(read_node_reports(uri, endpoint)) == ["gpu-1", "gpu-2"]


def test_verdict_names_failed_missing_and_stale_nodes():
    reports = {
        "n1": {"node": "n1", "ok": True, "slurm_job_id": "7"},
        "n2": {"node": "n2", "ok": False, "reason": "disk: 0.1 GB free", "slurm_job_id": "7"},
        "n3": {"node": "n3", "ok": True, "slurm_job_id": "6"},  # an earlier job's pass says nothing now
    }
    bad = bad_nodes_of(reports, ["n1", "n2", "n3", "n4"], "7")
    assert list(bad) == ["n2", "n3", "n4"]
    assert bad["n2"] == "disk: 0.1 GB free"
    assert "no health report from this job" in bad["n3"] and "no health report" in bad["n4"]
    assert bad_nodes_of(reports, ["n1"], "7") == {}


def test_fault_hook_fails_only_the_node_it_names(tmp_path, monkeypatch):
    cfg = tiny_config()
    store = open_store(f"file://{tmp_path / 'out'}")
    monkeypatch.setenv("EIGHTFOLD_NODE_SCRATCH", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    monkeypatch.setenv(FAULT_ENV, "other-node,bad-node")
    healthy = check_node(cfg, store, "good-node")
    assert healthy.ok and [c.name for c in healthy.checks] == ["devices", "matmul", "disk", "store"]
    assert str(tmp_path / "scratch") in healthy.get("disk").detail  # free space of the node's own scratch
    sick = check_node(cfg, store, "bad-node")
    assert sick.failed == ["injected"] and FAULT_ENV in sick.get("injected").detail


def test_verdict_writes_a_failed_result_naming_the_node(tmp_path, monkeypatch):
    spec = JobSpec(job_id="j", stage="pretrain", config=tiny_config().model_dump(mode="json"),
                   output=f"file://{tmp_path / 'out'}", workdir=str(tmp_path / "work"))
    job_file = spec.write(tmp_path / "job.yaml")
    store = open_store(spec.output)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    write_node_report(store, "n1", True, "", slurm_job_id="41")
    assert verdict(str(job_file), ["n1"]) == 0 and read_result(spec) is None  # healthy: training may start
    write_node_report(store, "n2", False, "injected: named by the fault hook", slurm_job_id="41")
    assert verdict(str(job_file), ["n1", "n2"]) == NODE_HEALTH_EXIT
    result = read_result(spec)
    assert result.status == "failed" and "node health failed on n2" in result.message
    assert result.bad_nodes == {"n2": "injected: named by the fault hook"}


def test_trainer_preflight_reports_the_bad_node_to_the_output_store(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "vm-2")  # inside a Slurm job the node is Slurm's name
    assert node_name() == "vm-2"
    uri = f"file://{tmp_path / 'out'}"
    with pytest.raises(PreflightFailed, match="rank 1 on node vm-2 pre-flight failed: disk"):
        preflight(torch.device("cpu"), tmp_path / "work", open_store(uri), rank=1, min_free_gb=1e12)
    bad = read_bad_nodes_from_store(uri)
    assert list(bad) == ["vm-2"] and bad["vm-2"].startswith("rank 1: disk")


def test_a_job_on_a_node_works_in_that_nodes_scratch(tmp_path, monkeypatch):
    spec = JobSpec(job_id="pretrain-9", stage="pretrain", config={}, output="s3://bucket/out",
                   workdir="/shared/jobs/pretrain-9")
    monkeypatch.delenv("EIGHTFOLD_NODE_SCRATCH", raising=False)
    assert spec.on_this_node() == spec  # local launcher: unchanged
    monkeypatch.setenv("EIGHTFOLD_NODE_SCRATCH", str(tmp_path / "node-a"))
    local = spec.on_this_node()
    assert local.workdir == str(tmp_path / "node-a" / "eightfold-jobs" / "pretrain-9")
    assert local.output == spec.output and spec.workdir == "/shared/jobs/pretrain-9"
