"""`eightfold drill node-loss`: lose one node of a two-node training job at a random step and prove the
retry gets the job back (seed: "A node failure mid-run should cost minutes, not days: the job restarts
from the last checkpoint").

The nodes are Slurm's when a Slurm with two nodes answers here (infra/slurm: two slurmd on this
machine), else the local launcher's simulated nodes; either way each node has its own folder, job file
and input cache, and they share nothing but the store. The drill runs the config's pretrain job:
1. the reference: two nodes x one rank, never interrupted;
2. the drilled job on two nodes; when rank 1 has finished a random step after the first committed
   checkpoint (held there by trainer/faults.py until then), every process of its node is SIGKILLed at
   once (agent and ranks: the node is gone);
   the other node's collectives fail and the launch ends `failed`;
3. the retry, as the stage's task would launch it (`resume: latest`, the next attempt number): on two
   nodes again, or with `elastic` on the node that is left (Slurm: the lost node excluded), the
   checkpoint resharded from two data-parallel ranks to one.
On the same mesh the retried job must end with exactly the reference's weights and loss; on one node
the loss must agree within `ELASTIC_RTOL` (the reduction order of the gradients differs).

`shared_paths` counts the files written by the ranks of both nodes (opened for writing, or a rename's
target), seen by a Python audit hook in every rank (trainer/audit.py): 0 when no node needs a path
another node sees. The drill itself runs on the machine that hosts the nodes: it reads rank 1's
heartbeat in its node's folder and kills that node's processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from infra.config import LifecycleConfig
from infra.launch import LocalLauncher, read_result
from infra.launch.job import JobResult, JobSpec
from infra.store import open_store
from infra.workspace import Workspace
from trainer.checkpoint import committed_steps
from trainer.faults import ENV as FAULTS_ENV

AUDIT_ENV = "EIGHTFOLD_AUDIT_WRITES"  # trainer/audit.py
# dp2 -> dp1 after the resume changes the order gradients are summed in, so bit-equality is not promised
# (the test model in fp32 on CPU happened to end bit-equal); 1e-4 relative leaves room for that order.
ELASTIC_RTOL = 1e-4


class DrillFailed(RuntimeError):
    pass


def _drill_config(cfg: LifecycleConfig, nnodes: int) -> LifecycleConfig:
    """The config's pretrain on `nnodes` nodes x 1 rank, data parallel (ZeRO-1) over the nodes."""
    data = cfg.model_dump(mode="json")
    # ZeRO-1: the optimizer state is sharded over the nodes, so the elastic retry reshards it
    data["parallel"].update(nnodes=nnodes, nproc_per_node=1, dp=nnodes, zero=1, dp_replicate=1, tp=1, pp=1, cp=1,
                            ep=1)
    data["infra"]["launcher"] = "local"
    return LifecycleConfig.model_validate(data)


def _spec(cfg: LifecycleConfig, ws: Workspace, tokens_uri: str, drill_id: str, name: str) -> JobSpec:
    job_id = f"drill-{drill_id}-{name}"
    return JobSpec(job_id=job_id, stage="drill/node-loss", section="pretrain", config=cfg.model_dump(mode="json"),
                   inputs={"tokens": tokens_uri},
                   output=ws.store.url(f"{ws.experiment}/drills/node-loss/{drill_id}/{name}"),
                   workdir=str(ws.path("jobs", job_id)), resume="latest")


def _read_step(path: Path | None) -> int:
    try:
        return int(json.loads(path.read_text())["step"]) if path else -1
    except (OSError, ValueError, KeyError):
        return -1


class LocalNodes:
    """Two nodes simulated by the local launcher (a folder each). The drill runs on the machine that
    hosts them, so it may read a node's heartbeat and kill its processes."""

    name = "local"

    def launch(self, spec: JobSpec, cfg: LifecycleConfig, audit: Path, lost: str | None = None):
        launcher = LocalLauncher(cfg.parallel.nproc_per_node, cfg.parallel.nnodes, max_restarts=0, node_dirs=True,
                                 env={"EIGHTFOLD_DEVICE": cfg.infra.device, AUDIT_ENV: str(audit)})
        return launcher.submit(spec, spec.write(Path(spec.workdir) / f"job-{spec.attempt}.yaml"))

    def heartbeat(self, spec: JobSpec, rank: int) -> tuple[int, str | None]:
        """(last step rank `rank` finished, its node): one rank per node, so node = rank."""
        return _read_step(LocalLauncher.node_dir(spec, rank) / "heartbeat" / f"rank{rank}.json"), f"node{rank}"

    def kill(self, handle, node: str) -> None:
        handle.kill_node(int(node.removeprefix("node")))


class SlurmNodes:
    """The two Slurm nodes of infra/slurm on this machine (multiple-slurmd): each node's scratch is
    `$EIGHTFOLD_SLURM_STATE/nodes/<node>/tmp`, and a node's processes carry SLURMD_NODENAME."""

    name = "slurm"

    def __init__(self):
        self.state = Path(os.environ.get("EIGHTFOLD_SLURM_STATE", "/var/lib/eightfold-slurm"))

    @staticmethod
    def up(min_nodes: int = 2) -> bool:
        """Whether a Slurm answers here with `min_nodes` usable nodes."""
        if not shutil.which("sinfo"):
            return False
        try:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return False
        states = [line.split()[1] for line in out.stdout.splitlines() if len(line.split()) == 2]
        return out.returncode == 0 and sum(s in ("idle", "mix", "alloc") for s in states) >= min_nodes

    def launch(self, spec: JobSpec, cfg: LifecycleConfig, audit: Path, lost: str | None = None):
        from infra.launch.slurm import SlurmLauncher

        slurm = cfg.infra.slurm.model_copy(update={"exclude": [*cfg.infra.slurm.exclude, *([lost] if lost else [])]})
        launcher = SlurmLauncher(slurm, env={"EIGHTFOLD_DEVICE": cfg.infra.device, AUDIT_ENV: str(audit)},
                                 exclude_file=Path(spec.workdir) / "exclude-nodes.txt")
        return launcher.submit(spec, spec.write(Path(spec.workdir) / f"job-{spec.attempt}.yaml"))

    def heartbeat(self, spec: JobSpec, rank: int) -> tuple[int, str | None]:
        found = sorted(self.state.glob(f"nodes/*/tmp/eightfold-jobs/{spec.job_id}/heartbeat/rank{rank}.json"))
        if not found:
            return -1, None
        return _read_step(found[0]), found[0].relative_to(self.state / "nodes").parts[0]

    def kill(self, handle, node: str) -> None:
        """SIGKILL every process of the job on `node` (the task, torchrun, its ranks) at once; srun's
        --kill-on-bad-exit then ends the job on the other node."""
        import psutil

        victims = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if env.get("SLURM_JOB_ID") == handle.slurm_id and env.get("SLURMD_NODENAME") == node:
                victims.append(p)
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=10)


def nodes_for(launcher: str) -> LocalNodes | SlurmNodes:
    """`auto`: Slurm when it is up with two nodes, else the local launcher's simulated nodes."""
    if launcher == "slurm" or (launcher == "auto" and SlurmNodes.up()):
        return SlurmNodes()
    if launcher in ("local", "auto"):
        return LocalNodes()
    raise ValueError(f"launcher={launcher!r}: use auto, local or slurm")


def _wait_completed(spec: JobSpec, handle, what: str, timeout: float) -> JobResult:
    code = handle.wait(timeout)
    result = read_result(spec)
    if code != 0 or result is None or result.status != "completed":
        tail = "".join(handle.log_path.read_text(errors="replace").splitlines(True)[-30:])
        raise DrillFailed(f"{what}: exit code {code}, result {result and result.status}; log {handle.log_path}\n{tail}")
    return result


def _writes(audit: Path, store) -> dict[str, set[str]]:
    """node -> paths its ranks wrote, over every run of the drill (the audit files the ranks appended to;
    a node is its folder's name, node0 or node1, or its Slurm name). Paths inside a file:// store are
    not counted: the store is the one thing the nodes share on purpose."""
    from infra.store import FileStore

    root = str(store.root) + "/" if isinstance(store, FileStore) else None
    out: dict[str, set[str]] = {}
    for f in audit.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if root is None or not rec["path"].startswith(root):
                out.setdefault(Path(rec["node"]).name, set()).add(rec["path"])
    return out


def _final_weights(spec: JobSpec, ws: Workspace) -> dict:
    """The model weights of the job's newest committed checkpoint, every file checked against its
    manifest on the way (trainer.checkpoint.fetch_verified)."""
    from stages.export.merge import find_checkpoint, load_full_state_dict
    from trainer.checkpoint import fetch_verified, read_manifest

    store = open_store(spec.output, endpoint_url=ws.s3_endpoint_url)
    ckpt = read_manifest(store, committed_steps(store)[0])
    return load_full_state_dict(find_checkpoint(fetch_verified(store, ckpt, Path(spec.workdir) / "final-checkpoint")))


def node_loss(cfg: LifecycleConfig, tokens_uri: str, *, elastic: bool | None = None, seed: int | None = None,
              launcher: str = "auto", timeout: float = 1800, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the drill on `launcher`'s nodes (auto: Slurm when it is up, else local); returns its JSON
    object (see the module docstring)."""
    import torch

    elastic = cfg.infra.elastic if elastic is None else elastic
    cluster = nodes_for(launcher)
    ws = Workspace.from_config(cfg)
    two = _drill_config(cfg, 2)
    steps, every = two.pretrain.steps, two.pretrain.checkpoint.every
    if not every or every >= steps - 1:
        raise DrillFailed(f"pretrain.checkpoint.every={every} with pretrain.steps={steps}: the drill needs a "
                          "checkpoint before the kill and steps after it (every < steps - 1)")
    rng = random.Random(seed)
    kill_at = rng.randint(every + 1, steps - 1)
    drill_id = uuid.uuid4().hex[:8]
    audit = ws.path("jobs", f"drill-{drill_id}-audit")

    log(f"drill: reference run on {cluster.name}, 2 nodes x 1 rank, {steps} steps")
    ref_spec = _spec(two, ws, tokens_uri, drill_id, "reference")
    reference = _wait_completed(ref_spec, cluster.launch(ref_spec, two, audit), "the reference run", timeout)

    spec = _spec(two, ws, tokens_uri, drill_id, "drilled")
    # Rank 1 is held after step kill_at (its training thread sleeps; its checkpoint uploads go on) until
    # its node is killed, so the kill lands at kill_at on any machine's speed: unheld, a slow commit of
    # the first checkpoint let rank 1 run on to the last step before the kill. The retry (attempt 1) is
    # not held: faults fire on the job attempt they name only.
    hold = {"hang_rank": 1, "hang_step": kill_at, "hang_mode": "sleep"}
    spec = spec.model_copy(update={"env": {**spec.env, FAULTS_ENV: json.dumps(hold)}})
    log(f"drill: drilled run; the node of rank 1 is lost after step {kill_at}")
    handle = cluster.launch(spec, two, audit)
    deadline = time.monotonic() + timeout
    output = open_store(spec.output, endpoint_url=ws.s3_endpoint_url)
    # the kill comes at kill_at or later, once a checkpoint is committed (else there is nothing to resume)
    while (beat := cluster.heartbeat(spec, 1))[0] < kill_at or not committed_steps(output):
        if handle.poll() not in ("pending", "running"):
            raise DrillFailed(f"the drilled job ended before step {kill_at} (log {handle.log_path})")
        if time.monotonic() > deadline:
            handle.cancel()
            raise DrillFailed(f"the drilled job did not reach step {kill_at} in {timeout} s")
        time.sleep(0.05)
    lost = beat[1]
    killed_at = time.time()
    cluster.kill(handle, lost)
    done = cluster.heartbeat(spec, 1)[0]  # final now: the last step rank 1 finished before its node went
    log(f"drill: node {lost} killed after step {done}")
    if handle.wait(timeout) == 0:
        raise DrillFailed(f"the drilled job completed although node {lost} was killed")

    retry_cfg = _drill_config(cfg, 1) if elastic else two
    retry = spec.model_copy(update={"attempt": 1, "previous_attempt_ended_at": killed_at,
                                    "config": retry_cfg.model_dump(mode="json")})
    log(f"drill: retry on {retry_cfg.parallel.nnodes} node(s), resuming from the latest checkpoint")
    final = _wait_completed(retry, cluster.launch(retry, retry_cfg, audit, lost=lost if elastic else None),
                            "the retry", timeout)

    resumed_from = final.resumed_from_step if final.resumed_from_step is not None else 0
    loss, ref_loss = final.metrics["loss"], reference.metrics["loss"]
    if elastic:
        equal = abs(loss - ref_loss) <= ELASTIC_RTOL * abs(ref_loss)
    else:
        a, b = _final_weights(retry, ws), _final_weights(ref_spec, ws)
        equal = loss == ref_loss and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    writes = _writes(audit, ws.store)
    nodes_of: dict[str, set[str]] = {}
    for node, paths in writes.items():
        for path in paths:
            nodes_of.setdefault(path, set()).add(node)
    shared = {path for path, by in nodes_of.items() if len(by) > 1}
    return {
        "launcher": cluster.name, "nodes": two.parallel.nnodes, "elastic": elastic, "lost_node": lost,
        "killed_at_step": done,
        "resumed_from_step": resumed_from, "resumed_on_nodes": retry_cfg.parallel.nnodes,
        "checkpoint_uri": final.checkpoint, "lost_steps": done - resumed_from,
        "restart_s": round(final.metrics.get("restart_s", float("nan")), 3), "final_loss": loss,
        "reference_final_loss": ref_loss, "equal": bool(equal),
        "tolerance": f"relative {ELASTIC_RTOL:g} on the loss" if elastic else "bit for bit (weights and loss)",
        "shared_paths": len(shared), "shared_path_examples": sorted(shared)[:5],
        "written_paths_per_node": sorted(len(paths) for paths in writes.values()),
    }
