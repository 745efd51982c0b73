"""Health per node before a job trains: one probe on each node the scheduler gave the job, then one
verdict over all of them.

    srun --nodes=N --ntasks-per-node=1 python -m infra.node_health probe JOB.yaml   # on every node
    python -m infra.node_health verdict JOB.yaml --nodes n1,n2                       # once, after it

`probe` runs infra/health.py's checks that concern one node (devices, matmul, free disk in the node's
scratch dir, a write/read/delete in the job's output store) and writes the node's report to
`{output}/health/<node>.json`: the object store is the only thing the nodes and the stage share.
`verdict` reads the reports of this allocation back. When a node failed, or left no report of this
Slurm job (its probe crashed or hung), it names the node in the log and in the job's result.json
(status failed, `bad_nodes`) and exits NODE_HEALTH_EXIT, so no training starts and the stage can
exclude the node from its retry (infra.health.read_bad_nodes_from_store).

Fault hook: EIGHTFOLD_FAULT_BAD_NODE=<node>[,<node>...] makes the probe on those nodes fail a check
named `injected`, so tests and drills can take a node out on purpose.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from types import SimpleNamespace

from infra.health import Check, HealthReport, node_name, read_node_reports, run_health, write_node_report

# EX_TEMPFAIL from sysexits.h: the job did not run because of its nodes; a retry elsewhere may work.
NODE_HEALTH_EXIT = 75
FAULT_ENV = "EIGHTFOLD_FAULT_BAD_NODE"
NODE_CHECKS = ("devices", "matmul", "disk", "store")


def log(msg: str) -> None:
    print(f"node-health: {msg}", file=sys.stderr, flush=True)


def _spec_and_store(job_file: str):
    from infra.launch.base import endpoint_for
    from infra.launch.job import JobSpec
    from infra.store import open_store

    spec = JobSpec.read(job_file)
    return spec, open_store(spec.output, endpoint_url=endpoint_for(spec))


def node_scratch() -> str:
    """The node's own scratch dir: what the scheduler exported (EIGHTFOLD_NODE_SCRATCH, TMPDIR)."""
    return os.environ.get("EIGHTFOLD_NODE_SCRATCH") or tempfile.gettempdir()


def check_node(cfg, store, node: str) -> HealthReport:
    """infra/health.py's one-node checks, sized to take about a second on a CPU node."""
    from infra.health import resolve_device

    cpu = resolve_device(cfg.infra.device) == "cpu"
    workspace = SimpleNamespace(workdir=node_scratch(), store=store)
    report = run_health(cfg, workspace, NODE_CHECKS, matmul_n=256 if cpu else None, store_bytes=64 << 10)
    injected = [n.strip() for n in os.environ.get(FAULT_ENV, "").split(",") if n.strip()]
    if node in injected:
        report.checks.append(Check("injected", False, f"{FAULT_ENV}={os.environ[FAULT_ENV]} names this node"))
    return report


def probe(job_file: str) -> int:
    """Check this node and write its report to the job's output store; 0 healthy, NODE_HEALTH_EXIT not."""
    from infra.config import LifecycleConfig

    spec, store = _spec_and_store(job_file)
    node = node_name()
    report = check_node(LifecycleConfig.model_validate(spec.config), store, node)
    reason = "; ".join(f"{c.name}: {c.detail}" for c in report.checks if not c.ok)
    write_node_report(
        store, node, report.ok, reason, job_id=spec.job_id, attempt=spec.attempt,
        slurm_job_id=os.environ.get("SLURM_JOB_ID"), checks=report.to_dict()["checks"],
    )
    if report.ok:
        log(f"{node} ok: " + "; ".join(f"{c.name} {c.seconds:.1f}s" for c in report.checks))
        return 0
    log(f"{node} FAILED: {reason}")
    return NODE_HEALTH_EXIT


def bad_nodes_of(reports: dict[str, dict], nodes: list[str], slurm_job_id: str | None) -> dict[str, str]:
    """Nodes of this allocation that failed, or left no report of this Slurm job: node -> reason."""
    bad = {}
    for node in nodes:
        report = reports.get(node)
        if report is None or (slurm_job_id and str(report.get("slurm_job_id")) != slurm_job_id):
            bad[node] = "no health report from this job (the probe crashed, hung or never started)"
        elif not report.get("ok"):
            bad[node] = report.get("reason") or "failed"
    return bad


def verdict(job_file: str, nodes: list[str]) -> int:
    """0 when every node of the allocation passed; otherwise name the bad ones in the log and in
    result.json and return NODE_HEALTH_EXIT."""
    from infra.launch.base import endpoint_for, write_result
    from infra.launch.job import JobResult

    spec, _ = _spec_and_store(job_file)
    bad = bad_nodes_of(read_node_reports(spec.output, endpoint_for(spec)), nodes, os.environ.get("SLURM_JOB_ID"))
    if not bad:
        log(f"all {len(nodes)} node(s) healthy: {', '.join(nodes)}")
        return 0
    named = "; ".join(f"{n}: {r}" for n, r in bad.items())
    log(f"node health failed on {', '.join(bad)}; training not started ({named})")
    write_result(spec, JobResult(
        status="failed",
        message=f"node health failed on {', '.join(bad)}: {named}",
        bad_nodes=bad,
        exit_code=NODE_HEALTH_EXIT,
    ))
    return NODE_HEALTH_EXIT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node_health", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="check this node, write {output}/health/<node>.json")
    p.add_argument("job_file")
    v = sub.add_parser("verdict", help="read every node's report; name the bad ones, exit 75")
    v.add_argument("job_file")
    v.add_argument("--nodes", required=True, help="the allocation's nodes, comma-separated")
    args = parser.parse_args(argv)
    if args.command == "probe":
        return probe(args.job_file)
    return verdict(args.job_file, [n for n in args.nodes.split(",") if n])


if __name__ == "__main__":
    sys.exit(main())
