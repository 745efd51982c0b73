"""In-job health: a pre-flight check when a job starts and a heartbeat per rank while it runs (seed:
"Teams run health checks between jobs ... and set collective timeouts so a hung GPU is detected in
minutes").

Pre-flight, on every rank, with the measurements of infra.health run inside the job's own process
group: devices, a timed all-reduce over all ranks (its sum checked), matmul throughput against the
expected peak, free disk in the work dir, and (rank 0) a write/read/delete in the output store. A
failed check ends the job before training with a message naming it and the node, and leaves a report
in `{workdir}/bad-nodes/` and in the output store's `health/<node>.json` that the launching stage reads
to keep the node out of later submits (seed: "Teams run health checks between jobs, keep spare nodes
ready"; stages/pretrain.py, Slurm's exclude file). The collective timeout itself is
`parallel.collective_timeout_s`, on every process group (trainer.process_group.init_distributed for the
default group, trainer/parallel/mesh.py for every group made after it): a hung rank makes its peers'
collectives fail after that long, the job exits, and torchrun restarts it.

Heartbeat: each rank rewrites `{workdir}/heartbeat/rank{R}.json` (step, time, pid) after each step.
On restart, the newest heartbeat of the previous attempt is when the job was last known alive, so the
time from failure to the first new step can be measured (`restart_s`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.health import (Check, HealthReport, allreduce_bandwidth, expected_peak, matmul_throughput, node_name,
                          write_node_report)
from infra.store import Store


class PreflightFailed(RuntimeError):
    pass


def preflight(device: torch.device, workdir: str | Path, store: Store | None, rank: int,
              min_free_gb: float = 0.5, min_peak_fraction: float = 0.25) -> HealthReport:
    checks: list[Check] = []
    dev = device.type

    def timed(name, fn):
        t0 = time.perf_counter()
        try:
            check = fn()
        except Exception as exc:  # one failing check never hides the others
            check = Check(name, False, f"{type(exc).__name__}: {exc}")
        check.seconds = time.perf_counter() - t0
        checks.append(check)

    def devices():
        if dev == "cuda":
            p = torch.cuda.get_device_properties(device)
            return Check("devices", True, f"{p.name} {p.total_memory / 1e9:.0f} GB", {"name": p.name})
        return Check("devices", True, f"CPU, {os.cpu_count()} cores", {"cores": os.cpu_count()})

    def allreduce():
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return Check("allreduce", True, "one rank: nothing to reduce")
        f = allreduce_bandwidth(1 << 20 if dev == "cpu" else 64 << 20, 3, str(device))
        return Check("allreduce", f["correct"], f"{f['ranks']} ranks busbw {f['busbw_gbps']:.2f} GB/s"
                     + ("" if f["correct"] else ": WRONG SUM"), f)

    def matmul():
        f = matmul_throughput(str(device), n=256 if dev == "cpu" else 4096, iters=2 if dev == "cpu" else 10)
        peak = expected_peak(dev)
        if not peak:
            return Check("matmul", True, f"{f['flops'] / 1e12:.3f} TFLOP/s (no expected peak)", f)
        f["fraction_of_peak"] = f["flops"] / peak
        ok = f["fraction_of_peak"] >= min_peak_fraction
        return Check("matmul", ok, f"{f['flops'] / 1e12:.1f} TFLOP/s = {f['fraction_of_peak']:.0%} of peak", f)

    def disk():
        free = shutil.disk_usage(Path(workdir)).free / 1e9
        return Check("disk", free >= min_free_gb, f"{free:.1f} GB free in {workdir}", {"free_gb": free})

    def store_rw():
        key = f"_health/{uuid.uuid4().hex}"
        payload = os.urandom(4096)
        store.put_bytes(payload, key)
        same = store.get_bytes(key) == payload
        store.delete(key)
        return Check("store", same, f"{store.uri}: write/read/delete " + ("ok" if same else "READ BACK DIFFERENT BYTES"))

    Path(workdir).mkdir(parents=True, exist_ok=True)
    timed("devices", devices)
    timed("allreduce", allreduce)
    timed("matmul", matmul)
    timed("disk", disk)
    if store is not None and rank == 0:
        timed("store", store_rw)
    report = HealthReport(checks)
    if not report.ok:
        details = "; ".join(f"{c.name}: {c.detail}" for c in report.checks if not c.ok)
        node = report_bad_node(workdir, rank, details, store)
        raise PreflightFailed(f"rank {rank} on node {node} pre-flight failed: {details}")
    return report


BAD_NODES = "bad-nodes"


def report_bad_node(workdir: str | Path, rank: int, reason: str, store: Store | None = None) -> str:
    """Record that this rank's node failed pre-flight (one file per node and rank) and, given the job's
    output store, in `{output}/health/<node>.json` too, where the stage reads it whatever node this
    was (infra.health.read_bad_nodes_from_store). Returns the node name (Slurm's, inside a job)."""
    node = node_name()
    folder = Path(workdir) / BAD_NODES
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{node}.rank{rank}.json").write_text(
        json.dumps({"node": node, "rank": rank, "reason": reason, "time": time.time()}))
    if store is not None:
        try:
            write_node_report(store, node, False, f"rank {rank}: {reason}", rank=rank, source="trainer pre-flight")
        except Exception as exc:  # the store may be what failed; the local record and the raise still stand
            print(f"trainer: could not write the bad-node report to {store.uri}: {exc}", flush=True)
    return node


def read_bad_nodes(workdir: str | Path) -> dict[str, str]:
    """Nodes reported by `report_bad_node` under `workdir`: node -> reason (the first rank's)."""
    out: dict[str, str] = {}
    for p in sorted((Path(workdir) / BAD_NODES).glob("*.json")):
        try:
            r = json.loads(p.read_text())
            out.setdefault(r["node"], f"rank {r['rank']}: {r['reason']}")
        except (OSError, ValueError, KeyError):
            continue
    return out


class Heartbeat:
    """One small JSON file per rank, rewritten after each step (atomic rename)."""

    def __init__(self, workdir: str | Path, rank: int):
        self.dir = Path(workdir) / "heartbeat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank{rank}.json"
        self.rank = rank

    def previous_last_seen(self) -> float | None:
        """The newest heartbeat time of any rank left by an earlier attempt (None on a first start)."""
        times = []
        for p in self.dir.glob("rank*.json"):
            try:
                times.append(json.loads(p.read_text())["time"])
            except (OSError, ValueError, KeyError):
                pass
        return max(times) if times else None

    def beat(self, step: int, **extra: Any) -> None:
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "step": step, "time": time.time(), "pid": os.getpid(), **extra}))
        os.replace(tmp, self.path)
