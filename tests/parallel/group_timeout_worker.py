"""Four gloo ranks on a 2x2 (dp, tp) mesh with parallel.collective_timeout_s = 5: each rank reports the
timeout of every group it belongs to, then runs three collectives, each with one member that never
joins (tp: rank 1; dp: rank 2; the checkpoint group: rank 3), timing how long the others wait.

Usage: torchrun --standalone --nproc-per-node=4 group_timeout_worker.py OUT_DIR
Writes OUT_DIR/rankR.json: {"timeouts": {group: seconds}, "phases": {phase: {"ok", "seconds", "error"}}}.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.config.train import CheckpointConfig
from infra.store import FileStore
from trainer.checkpoint import Checkpointer
from trainer.process_group import init_distributed
from trainer.parallel.mesh import build_parallel_dims

TIMEOUT_S = 5
ABSENT = {"tp": 1, "dp": 2, "checkpoint": 3}  # phase -> the rank that never joins it


def timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def timed(group) -> dict:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        return {"ok": True, "seconds": time.monotonic() - t0, "error": ""}
    except Exception as exc:  # the gloo timeout we are here for
        return {"ok": False, "seconds": time.monotonic() - t0, "error": f"{type(exc).__name__}: {exc}"[:400]}


def meet(store, name: str) -> None:
    """A barrier on the rendezvous store: no process group involved, so no group's timeout either."""
    key = f"group_timeout_worker/{name}"
    store.add(key, 1)
    deadline = time.monotonic() + 120
    while store.add(key, 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)


def main(out: Path) -> None:
    cfg = LifecycleConfig.model_validate({"model": {"moe": {"num_experts": 2}},
                                          "parallel": {"nproc_per_node": 4, "dp": 2, "tp": 2, "zero": 1, "ep": 2,
                                                       "collective_timeout_s": TIMEOUT_S}})
    init_distributed(cfg)
    rank = dist.get_rank()
    dims = build_parallel_dims(cfg.parallel, "cpu")
    ckpt = Checkpointer(FileStore(out / "store"), CheckpointConfig(), out / "staging", {"world_size": 4})
    groups = {"default": dist.group.WORLD, "tp": dims.group("tp"), "dp": dims.group("dp"),
              "checkpoint": ckpt.group, "ep": dims.group("ep"), "flattened": dims.flatten(("tp",), "tp_flat").get_group()}
    report = {"timeouts": {name: timeout_s(g) for name, g in groups.items()}, "phases": {}}
    store = dist.distributed_c10d._get_default_store()
    for phase, absent in ABSENT.items():
        meet(store, phase)  # every phase starts on every rank together, whatever the last one cost
        if rank != absent:
            report["phases"][phase] = timed(groups[phase])
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    # Absent ranks stay alive until every rank is done: a process that exits closes its sockets, and
    # its peers would fail at once on the closed connection instead of waiting out the timeout.
    meet(store, "done")
    time.sleep(1.0)  # the last rank's poll sees 4 too before rank 0's agent can tear things down
    sys.stdout.flush()
    os._exit(0)  # skip destroy_process_group: groups that timed out may not shut down cleanly


if __name__ == "__main__":
    main(Path(sys.argv[1]))
