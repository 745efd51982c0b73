"""Pre-flight health check: is this machine fit to run a job, and how fast is it?

The seed ("Failures are routine"): teams run health checks between jobs so a bad GPU, link or disk
is found before it costs a run. Checks, each timed and each allowed to fail on its own:

- devices:   CPU cores and memory, CUDA devices with names and memory;
- allreduce: a collective across local ranks (gloo on CPU, NCCL on CUDA) with its bus bandwidth;
- matmul:    matrix-multiply throughput (bf16 on GPU, fp32 on CPU) against the expected peak;
- disk:      free space in the work dir;
- store:     write, read back (checksum), delete an object in the artifact store;
- tracking:  the MLflow server or file answers and the experiment exists.

`run_health` has no Prefect in it: a Prefect task, the CLI and trainer code all call it.
`allreduce_bandwidth` and `matmul_throughput` also work inside a running job's process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import traceback
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urlparse

CHECKS = ("devices", "allreduce", "matmul", "disk", "store", "tracking")

# Dense bf16 peak FLOP/s by device name. H100 SXM from the seed ("peaks near 989 dense bf16
# TFLOP/s"); H200 has the same compute die; A100 from NVIDIA's datasheet. Unknown devices: no peak.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class HealthReport:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def get(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; ran {[c.name for c in self.checks]}")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": self.failed, "checks": [asdict(c) for c in self.checks]}


# --- measurements usable anywhere --------------------------------------------------------------------
def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU is visible, else cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def allreduce_bandwidth(nbytes: int, iters: int, device: str, group=None) -> dict[str, float]:
    """Time an all-reduce of `nbytes` in the current process group; every rank gets the figures.

    Bus bandwidth as the seed's ring counts it: each rank sends 2(N-1)/N of the buffer, so
    busbw = algbw * 2(N-1)/N with algbw = bytes / time (the convention of nccl-tests).
    """
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device)
    # Correctness first: rank r contributes r+1, so every element must become N(N+1)/2.
    x.fill_(rank + 1)
    dist.all_reduce(x, group=group)
    _sync(device)
    expected = world * (world + 1) / 2
    correct = bool(torch.all(x == expected).item())
    x.fill_(1.0)
    dist.all_reduce(x, group=group)  # warm-up (connections, buffers)
    dist.barrier(group=group)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        x.fill_(1.0)  # keeps values finite; a fill is negligible next to the transfer
        dist.all_reduce(x, group=group)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
    t = float(elapsed.item())
    size = x.numel() * 4
    algbw = size / t
    return {
        "ranks": world,
        "bytes": size,
        "iters": iters,
        "time_s": t,
        "algbw_gbps": algbw / 1e9,
        "busbw_gbps": algbw * 2 * (world - 1) / world / 1e9,
        "correct": correct,
    }


def matmul_throughput(device: str, n: int | None = None, iters: int | None = None) -> dict[str, float]:
    """FLOP/s of an n x n x n matmul: 2n^3 FLOPs each (a multiply and an add per term)."""
    import torch

    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    n = n or (8192 if on_gpu else 1024)
    iters = iters or (30 if on_gpu else 4)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: kernel selection, allocation
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    t = (time.perf_counter() - start) / iters
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "time_s": t, "flops": 2 * n**3 / t}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _allreduce_worker(rank: int, world: int, backend: str, device: str, init_file: str, out_file: str, nbytes: int, iters: int) -> None:
    """One spawned rank of the health all-reduce (module-level so spawn can import it)."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        figures = allreduce_bandwidth(nbytes, iters, device)
        if rank == 0:
            Path(out_file).write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def spawn_allreduce(nranks: int, device: str, nbytes: int, iters: int, timeout_s: float = 120.0) -> dict[str, float]:
    """Start `nranks` local processes (spawn), all-reduce among them, return rank 0's figures."""
    import torch.multiprocessing as mp

    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="eightfold-health-") as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "figures.json")
        ctx = mp.start_processes(
            _allreduce_worker,
            args=(nranks, backend, device, init_file, out_file, nbytes, iters),
            nprocs=nranks,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):  # raises ProcessRaisedException when a rank fails
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{nranks}-rank {backend} all-reduce did not finish in {timeout_s:.0f} s (hung rank?)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        figures = json.loads(Path(out_file).read_text())
    figures["backend"] = backend
    return figures


# --- the checks ----------------------------------------------------------------------------------
def _check_devices(cfg, workspace, opts) -> Check:
    import psutil
    import torch

    device = resolve_device(cfg.infra.device)
    mem = psutil.virtual_memory()
    figures: dict[str, Any] = {
        "device": device,
        "cpu_cores": os.cpu_count() or 0,
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": round(mem.total / 1e9, 2),
        "memory_available_gb": round(mem.available / 1e9, 2),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    gpus = []
    for i in range(figures["cuda_devices"]):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 1e9, 2)})
    if gpus:
        figures["gpus"] = gpus
    need = cfg.parallel.nproc_per_node
    if cfg.infra.device == "cuda" and not gpus:
        return Check("devices", False, "infra.device=cuda but no CUDA device is visible", figures)
    if device == "cuda" and need > len(gpus):
        return Check("devices", False, f"parallel.nproc_per_node={need} but only {len(gpus)} CUDA device(s)", figures)
    if gpus:
        names = ", ".join(sorted({g["name"] for g in gpus}))
        detail = f"{len(gpus)} x {names} ({gpus[0]['memory_gb']} GB), {figures['usable_cores']} CPU cores"
    else:
        detail = f"CPU only: {figures['usable_cores']} cores, {figures['memory_gb']} GB memory"
    return Check("devices", True, detail, figures)


def _check_allreduce(cfg, workspace, opts) -> Check:
    import torch

    device = resolve_device(cfg.infra.device)
    if device == "cuda":
        nranks = opts.get("nranks") or torch.cuda.device_count()
        nbytes = opts.get("allreduce_bytes") or 256 << 20
        iters = 20
    else:
        nranks = opts.get("nranks") or 2
        nbytes = opts.get("allreduce_bytes") or 8 << 20
        iters = 5
    f = spawn_allreduce(nranks, device, nbytes, iters, timeout_s=opts.get("timeout_s", 120.0))
    if not f["correct"]:
        return Check("allreduce", False, f"{nranks}-rank {f['backend']} all-reduce returned a wrong sum", f)
    detail = (
        f"{nranks} ranks {f['backend']}, {f['bytes'] / 2**20:.0f} MiB: "
        f"busbw {f['busbw_gbps']:.2f} GB/s (algbw {f['algbw_gbps']:.2f} GB/s, {f['time_s'] * 1e3:.1f} ms)"
    )
    if nranks == 1:
        detail += "; one device, so no bytes cross a link"
    return Check("allreduce", True, detail, f)


def expected_peak(device: str) -> float | None:
    """Peak FLOP/s of device 0: EIGHTFOLD_PEAK_FLOPS when set, else the table for known GPUs."""
    if os.environ.get("EIGHTFOLD_PEAK_FLOPS"):
        return float(os.environ["EIGHTFOLD_PEAK_FLOPS"])
    if device != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(0)
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name.split() or f" {key}" in name or name.startswith(key):
            return peak
    return None


def _check_matmul(cfg, workspace, opts) -> Check:
    device = resolve_device(cfg.infra.device)
    f = matmul_throughput(device, n=opts.get("matmul_n"))
    peak = opts.get("expected_peak_flops") or expected_peak(device)
    detail = f"{f['n']}^3 {f['dtype']}: {f['flops'] / 1e12:.3f} TFLOP/s"
    if not peak:
        return Check("matmul", True, detail + " (no expected peak known for this device)", f)
    f["expected_peak_flops"] = peak
    f["fraction_of_peak"] = f["flops"] / peak
    floor = opts.get("min_peak_fraction", 0.25)
    detail += f" = {f['fraction_of_peak']:.0%} of the expected {peak / 1e12:.0f} TFLOP/s"
    if f["fraction_of_peak"] < floor:
        return Check("matmul", False, detail + f", below the {floor:.0%} floor (throttled or faulty device?)", f)
    return Check("matmul", True, detail, f)


def _check_disk(cfg, workspace, opts) -> Check:
    workdir = Path(workspace.workdir)
    probe = workdir
    while not probe.exists():  # the work dir may not exist yet: measure the disk it will be on
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    free_gb = usage.free / 1e9
    floor = opts.get("min_free_gb", 1.0)
    f = {"path": str(workdir), "free_gb": round(free_gb, 2), "total_gb": round(usage.total / 1e9, 2), "min_free_gb": floor}
    detail = f"{free_gb:.1f} GB free of {usage.total / 1e9:.0f} GB at {workdir}"
    if free_gb < floor:
        return Check("disk", False, detail + f", under the {floor} GB minimum", f)
    return Check("disk", True, detail, f)


def _check_store(cfg, workspace, opts) -> Check:
    store = workspace.store
    key = f"_health/{uuid.uuid4().hex}.bin"
    payload = os.urandom(opts.get("store_bytes", 1 << 20))
    t0 = time.perf_counter()
    store.put_bytes(payload, key)
    t1 = time.perf_counter()
    if not store.exists(key):
        return Check("store", False, f"{store.url(key)} missing right after it was written", {"uri": store.uri})
    back = store.get_bytes(key)
    t2 = time.perf_counter()
    same = hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
    store.delete(key)
    gone = not store.exists(key)
    f = {
        "uri": store.uri,
        "bytes": len(payload),
        "write_mb_s": len(payload) / 1e6 / max(t1 - t0, 1e-9),
        "read_mb_s": len(payload) / 1e6 / max(t2 - t1, 1e-9),
    }
    if not same:
        return Check("store", False, f"{store.url(key)} read back different bytes (sha256 mismatch)", f)
    if not gone:
        return Check("store", False, f"{store.url(key)} still exists after delete", f)
    return Check("store", True, f"{store.uri}: write/read/delete of {len(payload) / 2**20:.1f} MiB ok", f)


def _check_tracking(cfg, workspace, opts) -> Check:
    from infra.tracking import Tracker

    uri = workspace.tracking_uri
    f: dict[str, Any] = {"uri": uri}
    if urlparse(uri).scheme in ("http", "https"):
        # Ask /health with a short timeout first: MLflow's client retries with backoff for minutes.
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=opts.get("tracking_timeout_s", 5)) as r:
                if r.status != 200:
                    return Check("tracking", False, f"{uri}/health answered HTTP {r.status}", f)
        except OSError as exc:
            return Check("tracking", False, f"{uri} unreachable: {exc}", f)
    t0 = time.perf_counter()
    tracker = Tracker.for_workspace(workspace)
    exp = tracker.client.get_experiment(tracker.experiment_id)
    f.update(experiment=exp.name, experiment_id=exp.experiment_id, artifact_location=exp.artifact_location)
    f["latency_ms"] = (time.perf_counter() - t0) * 1e3
    return Check("tracking", True, f"{uri}: experiment {exp.name!r} (id {exp.experiment_id})", f)


_CHECK_FNS: dict[str, Callable[[Any, Any, dict], Check]] = {
    "devices": _check_devices,
    "allreduce": _check_allreduce,
    "matmul": _check_matmul,
    "disk": _check_disk,
    "store": _check_store,
    "tracking": _check_tracking,
}


def run_health(cfg, workspace, checks: Iterable[str] | None = None, **opts: Any) -> HealthReport:
    """Run the checks (all by default) and report each; one failing never stops the others.

    Options: nranks, allreduce_bytes, timeout_s, matmul_n, expected_peak_flops, min_peak_fraction
    (default 0.25), min_free_gb (default 1.0), store_bytes, tracking_timeout_s.
    """
    names = list(checks) if checks is not None else list(CHECKS)
    unknown = [n for n in names if n not in _CHECK_FNS]
    if unknown:
        raise ValueError(f"unknown health check(s) {unknown}; known: {', '.join(CHECKS)}")
    report = []
    for name in names:
        start = time.perf_counter()
        try:
            check = _CHECK_FNS[name](cfg, workspace, opts)
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            where = f" ({Path(last.filename).name}:{last.lineno})"
            check = Check(name, False, f"{type(exc).__name__}: {exc}{where}")
        check.seconds = time.perf_counter() - start
        report.append(check)
    return HealthReport(report)


def health_command(config: str | None, overrides: list[str], as_json: bool, checks: list[str] | None = None) -> int:
    """`eightfold health [CONFIG] [--set k=v] [--json]`: 0 when every check passed, 1 when one
    failed (named on the last line), 2 for a bad config or check name."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from infra.config import ConfigError, load_config
    from infra.workspace import Workspace

    console = Console(stderr=as_json)
    try:
        cfg = load_config(config, overrides)
        report = run_health(cfg, Workspace.from_config(cfg), checks)
    except (ConfigError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/red]", highlight=False)
        return 2
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        table = Table(title=f"eightfold health: {cfg.name}")
        table.add_column("check")
        table.add_column("ok")
        table.add_column("detail", overflow="fold")
        table.add_column("s", justify="right")
        for c in report.checks:
            table.add_row(c.name, "[green]yes[/green]" if c.ok else "[red]NO[/red]", escape(c.detail), f"{c.seconds:.1f}")
        console.print(table)
    if report.ok:
        console.print(f"health: all {len(report.checks)} checks passed")
        return 0
    console.print(f"[red]health check failed: {', '.join(report.failed)}[/red]")
    return 1


# --- per-node reports in a job's output store ------------------------------------------------------
# A job's nodes share nothing but the object store, so each node's health verdict is written there,
# next to the job's result: `{output}/health/<node>.json`. The stage reads the bad ones back to keep
# those nodes out of its retry (Slurm: the exclude file every later submit reads).
NODE_REPORTS = "health"


def node_name() -> str:
    """This node's name as the scheduler knows it: Slurm's SLURMD_NODENAME inside a job (several
    nodes on one machine share a hostname), Kubernetes' spec.nodeName (EIGHTFOLD_NODE_NAME, set by the
    launcher's pod template; a pod's hostname is the pod's), else the hostname."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or os.environ.get("EIGHTFOLD_NODE_NAME") or socket.gethostname()


def write_node_report(store, node: str, ok: bool, reason: str, **meta: Any) -> str:
    """Record one node's verdict (a healthy node's too: a later pass clears an earlier failure).
    Returns the key written."""
    key = f"{NODE_REPORTS}/{node}.json"
    store.put_json({"node": node, "ok": ok, "reason": reason, "time": time.time(), **meta}, key)
    return key


def read_node_reports(output_uri: str, endpoint_url: str | None = None) -> dict[str, dict[str, Any]]:
    """Every node report under `{output_uri}/health/`: node -> report. Unreadable ones are skipped."""
    from infra.store import open_store

    store = open_store(output_uri, endpoint_url=endpoint_url)
    reports: dict[str, dict[str, Any]] = {}
    try:
        keys = store.list(NODE_REPORTS)
    except FileNotFoundError:
        return reports
    for key in keys:
        if not key.endswith(".json"):
            continue
        try:
            report = store.get_json(key)
            reports[str(report["node"])] = report
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return reports


def read_bad_nodes_from_store(output_uri: str, endpoint_url: str | None = None) -> dict[str, str]:
    """Nodes whose latest report in `{output_uri}/health/` failed: node -> reason (the same shape as
    trainer.health.read_bad_nodes, which reads a local work dir)."""
    reports = read_node_reports(output_uri, endpoint_url)
    return {node: r.get("reason", "") for node, r in sorted(reports.items()) if not r.get("ok")}
