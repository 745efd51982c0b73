"""`eightfold drill node-loss`: lose one node of a two-node training job at a random step and prove the
retry gets the job back (seed: "A node failure mid-run should cost minutes, not days: the job restarts
from the last checkpoint").

The drill runs the config's pretrain job three times against the store, with nothing shared between
the nodes but the store (each node has its own folder, job file copy and input cache):
1. the reference: two nodes x one rank, never interrupted;
2. the drilled job on two nodes; when node 1 has finished a random step between the first checkpoint
   and the end, every process of node 1 is SIGKILLed at once (agent and ranks: the node is gone);
   node 0's collectives fail and the launch ends `failed`;
3. the retry, as the stage's task would launch it (`resume: latest`, the next attempt number): on two
   nodes again, or with `elastic` on the node that is left, the checkpoint resharded from two data-
   parallel ranks to one.
On the same mesh the retried job must end with exactly the reference's weights and loss; on one node
the loss must agree within `ELASTIC_RTOL` (the reduction order of the gradients differs).

`shared_paths` counts the files both nodes' processes opened for writing outside the store, seen by a
Python audit hook in every rank (`EIGHTFOLD_AUDIT_WRITES`): 0 when no node needs a path another node sees.
"""

from __future__ import annotations

import json
import random
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

AUDIT_ENV = "EIGHTFOLD_AUDIT_WRITES"  # trainer/audit.py
# fp32 on CPU, dp2 -> dp1 after the resume: measured |rel diff| of the final loss ~1e-7 (see the test)
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
                   inputs={"tokens": tokens_uri}, output=ws.store.url(f"{ws.experiment}/drills/node-loss/{drill_id}/{name}"),
                   workdir=str(ws.path("jobs", job_id)), resume="latest")


def _launch(spec: JobSpec, cfg: LifecycleConfig, audit: Path):
    launcher = LocalLauncher(cfg.parallel.nproc_per_node, cfg.parallel.nnodes, max_restarts=0, node_dirs=True,
                             env={"EIGHTFOLD_DEVICE": cfg.infra.device, AUDIT_ENV: str(audit)})
    return launcher, launcher.submit(spec, spec.write(Path(spec.workdir) / f"job-{spec.attempt}.yaml"))


def _heartbeat_step(spec: JobSpec, node: int) -> int:
    """The last step node `node`'s rank finished (its heartbeat in the node's own folder; the drill
    runs on the machine that hosts the simulated nodes, so it may look)."""
    path = LocalLauncher.node_dir(spec, node) / "heartbeat" / "rank{}.json".format(node)
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def _wait_completed(spec: JobSpec, handle, what: str, timeout: float) -> JobResult:
    code = handle.wait(timeout)
    result = read_result(spec)
    if code != 0 or result is None or result.status != "completed":
        tail = "".join(handle.log_path.read_text(errors="replace").splitlines(True)[-30:])
        raise DrillFailed(f"{what}: exit code {code}, result {result and result.status}; log {handle.log_path}\n{tail}")
    return result


def _writes(audit: Path) -> dict[str, set[str]]:
    """node -> paths its ranks wrote, over every run of the drill (the audit files the ranks appended to;
    a node is its folder's name, node0 or node1, whichever job it ran)."""
    out: dict[str, set[str]] = {}
    for f in audit.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(Path(rec["node"]).name, set()).add(rec["path"])
    return out


def _final_weights(spec: JobSpec, ws: Workspace) -> dict:
    """The model weights of the job's newest committed checkpoint, read from the store."""
    from infra.store import join_key
    from stages.export.merge import find_checkpoint, load_full_state_dict
    from trainer.checkpoint import ROOT, step_dir

    store = open_store(spec.output, endpoint_url=ws.s3_endpoint_url)
    local = Path(spec.workdir) / "final-checkpoint"
    store.get_dir(join_key(ROOT, step_dir(committed_steps(store)[0])), local)
    return load_full_state_dict(find_checkpoint(local))


def node_loss(cfg: LifecycleConfig, tokens_uri: str, *, elastic: bool | None = None, seed: int | None = None,
              timeout: float = 1800, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the drill; returns its JSON object (see the module docstring)."""
    import torch

    elastic = cfg.infra.elastic if elastic is None else elastic
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

    log(f"drill: reference run, 2 nodes x 1 rank, {steps} steps")
    ref_spec = _spec(two, ws, tokens_uri, drill_id, "reference")
    _, handle = _launch(ref_spec, two, audit)
    reference = _wait_completed(ref_spec, handle, "the reference run", timeout)

    spec = _spec(two, ws, tokens_uri, drill_id, "drilled")
    log(f"drill: drilled run; node 1 is lost after step {kill_at}")
    _, handle = _launch(spec, two, audit)
    deadline = time.monotonic() + timeout
    output = open_store(spec.output, endpoint_url=ws.s3_endpoint_url)
    # the kill comes at kill_at or later, once a checkpoint is committed (else there is nothing to resume)
    while (done := _heartbeat_step(spec, 1)) < kill_at or not committed_steps(output):
        if handle.poll() != "running":
            raise DrillFailed(f"the drilled job ended before step {kill_at} (log {handle.log_path})")
        if time.monotonic() > deadline:
            handle.cancel()
            raise DrillFailed(f"the drilled job did not reach step {kill_at} in {timeout} s")
        time.sleep(0.05)
    killed_at = time.time()
    handle.kill_node(1)
    done = _heartbeat_step(spec, 1)  # final now: the last step node 1 finished before it went
    log(f"drill: node 1 killed after step {done}")
    code = handle.wait(timeout)
    if code == 0:
        raise DrillFailed("the drilled job completed although node 1 was killed")

    retry_cfg = _drill_config(cfg, 1) if elastic else two
    retry = spec.model_copy(update={"attempt": 1, "previous_attempt_ended_at": killed_at,
                                    "config": retry_cfg.model_dump(mode="json")})
    log(f"drill: retry on {retry_cfg.parallel.nnodes} node(s), resuming from the latest checkpoint")
    _, handle = _launch(retry, retry_cfg, audit)
    final = _wait_completed(retry, handle, "the retry", timeout)

    resumed_from = int(final.metrics.get("resumed_from_step", -1))
    loss, ref_loss = final.metrics["loss"], reference.metrics["loss"]
    if elastic:
        equal = abs(loss - ref_loss) <= ELASTIC_RTOL * abs(ref_loss)
    else:
        a, b = _final_weights(retry, ws), _final_weights(ref_spec, ws)
        equal = loss == ref_loss and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    writes = _writes(audit)
    nodes_of: dict[str, set[str]] = {}
    for node, paths in writes.items():
        for path in paths:
            nodes_of.setdefault(path, set()).add(node)
    shared = {path for path, by in nodes_of.items() if len(by) > 1}
    return {
        "nodes": 2, "elastic": elastic, "killed_at_step": done, "resumed_from_step": resumed_from,
        "resumed_on_nodes": retry_cfg.parallel.nnodes, "checkpoint_uri": final.checkpoint, "lost_steps": done - resumed_from,
        "restart_s": round(final.metrics.get("restart_s", float("nan")), 3), "final_loss": loss,
        "reference_final_loss": ref_loss, "equal": bool(equal),
        "tolerance": f"relative {ELASTIC_RTOL:g} on the loss" if elastic else "bit for bit (weights and loss)",
        "shared_paths": len(shared), "shared_path_examples": sorted(shared)[:5],
        "written_paths_per_node": sorted(len(paths) for paths in writes.values()),
    }
