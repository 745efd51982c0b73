"""Two Slurm nodes on this one machine (infra/slurm/start.sh, multiple-slurmd): each has its share of
the cores and its own scratch dir, a node that fails its health probe is named and kept out of the next submit, and the real trainer runs through `srun` on
2 nodes x 1 rank against the local S3 endpoint with the same losses as one process.

Skipped with the reason when the Slurm has fewer than two nodes (EIGHTFOLD_SLURM_NODES=1)."""

from __future__ import annotations

import json
import os
import subprocess
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch

from fixtures.trainer_data import byte_tokens, tiny_config  # noqa: F401 (a fixture)
from infra.config.launch import SlurmConfig
from infra.health import read_bad_nodes_from_store, read_node_reports
from infra.launch.job import JobSpec
from infra.launch.slurm import SlurmLauncher, record_bad_nodes
from infra.node_health import FAULT_ENV, NODE_HEALTH_EXIT
from infra.store import open_store
from trainer.checkpoint import committed_steps

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

pytestmark = pytest.mark.distributed


def _launcher(**kwargs) -> SlurmLauncher:
    return SlurmLauncher(SlurmConfig(time_limit="5", poll_interval_s=0.2), **kwargs)


def test_each_node_has_its_own_share_of_cores_and_its_own_scratch(slurm_cluster):
    nodes = slurm_cluster.require_nodes(2)
    cpus = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %c"], capture_output=True, text=True, check=True).stdout
    per_node = {line.split()[0]: int(line.split()[1]) for line in cpus.splitlines()}
    assert sum(per_node.values()) <= max(len(nodes), os.cpu_count()), per_node  # a share, not the whole machine
    step = subprocess.run(["srun", f"--nodes={len(nodes)}", "--ntasks-per-node=1", "sh", "-c",
                           'echo "$SLURMD_NODENAME $TMPDIR $EIGHTFOLD_NODE_SCRATCH"'],
                          capture_output=True, text=True, timeout=60)
    assert step.returncode == 0, step.stderr
    seen = {line.split()[0]: line.split()[1:] for line in step.stdout.splitlines()}
    assert sorted(seen) == nodes  # one task on each node
    for node, (tmpdir, scratch) in seen.items():
        assert tmpdir == scratch == str(slurm_cluster.state_dir / "nodes" / node / "tmp")


def test_a_node_failing_its_probe_is_named_and_the_next_submit_excludes_it(slurm_cluster, tmp_path):
    first, second = slurm_cluster.require_nodes(2)[:2]
    config = tiny_config().model_dump(mode="json")
    config["parallel"].update(nnodes=2, nproc_per_node=1, dp=2)
    spec = JobSpec(job_id="probe", stage="pretrain", config=config, output=f"file://{tmp_path / 'out'}",
                   workdir=str(tmp_path / "work"), env={FAULT_ENV: second, "EIGHTFOLD_TEST_MODE": "allreduce"})
    job_file = spec.write(tmp_path / "work" / "job.yaml")
    workers = {"module": "fixtures.launch_worker", "env": {"PYTHONPATH": str(TESTS)}}
    launcher = _launcher(exclude_file=tmp_path / "exclude.txt", **workers)
    job = launcher.submit(spec, job_file)
    assert job.wait(timeout=120) == NODE_HEALTH_EXIT, job.log_path.read_text()
    log = job.log_path.read_text()
    assert f"node health failed on {second}" in log and f"{first} ok" in log
    assert "rank 0/" not in log  # training never started
    result = launcher.result(spec)
    assert result.status == "failed" and list(result.bad_nodes) == [second]
    assert FAULT_ENV in result.bad_nodes[second]

    # What the stage does before its retry: the bad nodes from the output store into the exclude file.
    bad = read_bad_nodes_from_store(spec.output)
    assert list(bad) == [second]
    record_bad_nodes(launcher.exclude_file, sorted(bad), reason="node health")
    assert f"#SBATCH --exclude={second}" in launcher.render(spec, job_file)
    # The same job again, on the one node left: it would fail again if Slurm placed it on `second`.
    config["parallel"].update(nnodes=1, dp=1)
    retry = spec.model_copy(update={"job_id": "probe-retry", "config": config, "attempt": 1})
    job = launcher.submit(retry, retry.write(tmp_path / "work" / "retry.yaml"))
    assert job.wait(timeout=120) == 0, job.log_path.read_text()
    assert job.nodes == first
    assert launcher.result(retry).status == "completed"


def _losses(metrics_jsonl: str) -> list[float]:
    return [row["loss"] for row in map(json.loads, metrics_jsonl.splitlines()) if "loss" in row]


@pytest.mark.slow
def test_trainer_on_two_nodes_checkpoints_to_s3_and_equals_one_process(slurm_cluster, s3_store, s3_endpoint,
                                                                       byte_tokens, tmp_path):
    nodes = slurm_cluster.require_nodes(2)[:2]
    s3_store.put_dir(byte_tokens, "tokens")
    base = tiny_config(steps=4, checkpoint={"every": 2}).model_dump(mode="json")
    base["infra"].update(s3_endpoint_url=s3_endpoint, device="cpu")

    # Two nodes x one rank, dp2: tokens read from S3 and every output written there.
    two = json.loads(json.dumps(base))
    two["parallel"].update(nnodes=2, nproc_per_node=1, dp=2)
    job_id = f"two-{uuid.uuid4().hex[:8]}"  # its own folder in each node's scratch, whatever ran before
    spec = JobSpec(job_id=job_id, stage="pretrain", config=two, inputs={"tokens": s3_store.url("tokens")},
                   output=s3_store.url("two"), workdir=str(tmp_path / "two-work"))
    launcher = _launcher()
    job = launcher.submit(spec, spec.write(tmp_path / "two.yaml"))
    scratch = {node: slurm_cluster.state_dir / "nodes" / node / "tmp" / "eightfold-jobs" / job_id for node in nodes}
    try:
        # Meanwhile the reference, one process: dp1 with two micro-batches per step (the same global batch).
        one = json.loads(json.dumps(base))
        one["parallel"].update(nnodes=1, nproc_per_node=1, dp=1)
        ref = JobSpec(job_id="one", stage="pretrain", config=one, inputs={"tokens": str(byte_tokens)},
                      output=f"file://{tmp_path / 'one'}", workdir=str(tmp_path / "one-work"))
        proc = subprocess.run([sys.executable, "-m", "trainer", str(ref.write(tmp_path / "one.yaml"))], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _check_two_node_run(nodes, launcher, job, spec, s3_endpoint, scratch, tmp_path)
    finally:
        job.cancel()  # a no-op once it ended
        for folder in scratch.values():
            shutil.rmtree(folder, ignore_errors=True)


def _check_two_node_run(nodes, launcher, job, spec, s3_endpoint, scratch, tmp_path):
    assert job.wait(timeout=180) == 0, job.log_path.read_text()[-6000:]
    hostnames = subprocess.run(["scontrol", "show", "hostnames", job.nodes], capture_output=True, text=True)
    assert sorted(hostnames.stdout.split()) == nodes  # one rank on each node
    result = launcher.result(spec)
    assert result.status == "completed" and result.steps == 4

    out = open_store(spec.output, s3_endpoint)
    assert committed_steps(out) == [4, 2]  # each committed by its manifest, after both ranks' shards
    for step in (2, 4):
        files = out.get_json(f"checkpoints/step_{step:08d}/manifest.json")["files"]
        assert sorted(f for f in files if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"], files
        assert all(out.exists(f"checkpoints/step_{step:08d}/{f}") for f in files)
    assert result.checkpoint == out.url("checkpoints/step_00000004")
    reports = read_node_reports(spec.output, s3_endpoint)  # each node probed itself before training
    assert sorted(reports) == nodes and all(r["ok"] for r in reports.values())

    # No working state on a path both nodes use: each node fetched the tokens into its own scratch
    # dir, and the submit-side workdir holds only the script and the log.
    for node, folder in scratch.items():
        (cache,) = [p for p in (folder / "cache").glob("tokens-*") if p.is_dir()]  # beside its lock file
        assert sorted(p.name for p in cache.iterdir()) == ["train", "val"], node
    assert sorted(p.name for p in Path(spec.workdir).iterdir()) == ["logs"]

    # The same losses, step by step, as one process: dp's tolerance in tests/trainer/test_ddp.py.
    ref = _losses((tmp_path / "one" / "metrics.jsonl").read_text())
    got = _losses(out.get_bytes("metrics.jsonl").decode())
    assert len(ref) == 4 and ref[-1] < ref[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    print(f"losses one process {ref}, two nodes {got}")
