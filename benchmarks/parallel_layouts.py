"""Step time, tokens/s and bytes per step per mesh dimension of each parallel layout, on CPU with gloo.

The layouts are a table (LAYOUTS: name -> parallel: overrides); every layout of one world size runs
inside one torchrun launch (this file is also the worker), on the same model, global batch and seed,
and the one-process layout is measured in the same run as the baseline. Each layout: one warm-up
step that also counts collectives (trainer.parallel.comm_accounting), then `--steps` timed steps
(median). Prints one JSON line per layout, with ratios against the one-process figures:

    {"layout": "zero1_dp2", "world": 2, "step_s": ..., "tokens_per_s": ..., "speedup_vs_one": ...,
     "bytes_per_step": {"dp": ...}, "calls_per_step": {"dp": ...}, "bytes_vs_ddp": ...,
     "optimizer_state_bytes_rank0": ...}

On one 2-core machine several ranks share the cores, so the times show communication and
framework overhead, not the scaling a GPU cluster would give; the bytes are exact.

    python -m benchmarks.parallel_layouts [--dim 64 --layers 2 --seq 64 --steps 4 --only tp2,zero1_dp2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from trainer.data import MicroBatch
from trainer.loop import LanguageModelling, build_model, train_step, unwrap
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.comm_accounting import CommCounter
from trainer.parallel.zero1 import build_parallel_optimizer, optimizer_state_bytes

ROOT = Path(__file__).resolve().parents[1]

# name -> parallel: overrides. Other layouts (pipeline, context, expert parallel) add rows here.
LAYOUTS: dict[str, dict] = {
    "one": {},
    "ddp2": {"dp": 2},
    "zero1_dp2": {"dp": 2, "zero": 1},
    "zero2_dp2": {"dp": 2, "zero": 2},
    "zero3_dp2": {"dp": 2, "zero": 3},
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "ddp4": {"dp": 4},
    "zero1_dp4": {"dp": 4, "zero": 1},
    "zero3_dp4": {"dp": 4, "zero": 3},
    "hsdp_2x2": {"dp": 4, "zero": 3, "dp_replicate": 2},
    "tp2_zero1_dp2": {"tp": 2, "dp": 2, "zero": 1},
    "tp2_fsdp_dp2": {"tp": 2, "dp": 2, "zero": 3},
    # Pipeline and context parallel (trainer/parallel/pipeline.py, context_parallel.py); interleaved and
    # zero-bubble schedules need pp * virtual stages <= --layers (e.g. --layers 4).
    "pp2_gpipe": {"pp": 2, "pp_schedule": "gpipe"},
    "pp2_1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "cp2_ring": {"cp": 2, "cp_impl": "ring"},
    "cp2_ulysses": {"cp": 2, "cp_impl": "ulysses"},
    "cp4_ring": {"cp": 4, "cp_impl": "ring"},
    "dp2_cp2_pp2": {"dp": 2, "cp": 2, "pp": 2, "pp_schedule": "1f1b"},
    # ZeRO-1 composed with pipeline, context and tensor parallel; the seed's mesh (configs/seed-1b.yaml:
    # dp=2 x tp=2 (+SP) x pp=2, ZeRO-1, 1F1B; its 4 micro-batches of 2 per replica need --batch 16).
    "zero1_dp2_pp2": {"dp": 2, "pp": 2, "zero": 1, "pp_schedule": "1f1b"},
    "zero1_dp2_cp2": {"dp": 2, "cp": 2, "zero": 1},
    "tp2_cp2_zero1": {"tp": 2, "cp": 2, "zero": 1},
    "ddp8": {"dp": 8},
    "dp2_tp2_pp2": {"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b"},
    "seed_2x2x2": {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "sequence_parallel": True, "pp_schedule": "1f1b"},
}


def world_of(name: str) -> int:
    p = LAYOUTS[name]
    return p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1)


def config(name: str, a: argparse.Namespace) -> LifecycleConfig:
    vocab = 512
    return LifecycleConfig.model_validate({
        "name": "parallel-bench", "seed": 0,
        "model": {"vocab_size": vocab, "dim": a.dim, "n_layers": a.layers, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_dim": 4 * a.dim, "max_seq_len": a.seq},
        "tokenizer": {"vocab_size": vocab},
        "parallel": {"nproc_per_node": world_of(name), **LAYOUTS[name]},
        "pretrain": {"steps": a.steps + 1, "seq_len": a.seq, "micro_batch_size": a.micro,
                     "global_batch_size": a.batch, "lr": 1e-3, "warmup_steps": 0, "precision": "fp32",
                     "peak_flops": 1e11},
    })


def batches(cfg: LifecycleConfig, step: int, dp_rank: int, dp: int) -> list[MicroBatch]:
    t = cfg.pretrain
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=g)
    per = t.global_batch_size // dp
    mine = rows[dp_rank * per:(dp_rank + 1) * per]
    return [MicroBatch(mine[i:i + t.micro_batch_size, :-1], mine[i:i + t.micro_batch_size, 1:], None)
            for i in range(0, per, t.micro_batch_size)]


def measure(name: str, a: argparse.Namespace) -> dict:
    cfg = config(name, a)
    t = cfg.pretrain
    dims = build_parallel_dims(cfg.parallel, "cpu")
    model = parallelize(build_model(cfg), dims, cfg.parallel, t, device=torch.device("cpu"), seed=cfg.seed)
    opt = build_parallel_optimizer(unwrap(model), dims, cfg.parallel, t)
    objective, dp_group = LanguageModelling(), dims.group("dp")
    if dims.cp > 1:  # each rank its zigzag share; gradients and tokens over dp x cp
        from trainer.parallel.context_parallel import context_parallel_setup

        dp_group, objective = context_parallel_setup(dims, objective)
    cpu = torch.device("cpu")
    with CommCounter(dims.group_names()) as counter:  # warm-up step, counted
        train_step(model, opt, batches(cfg, 0, dims.rank("dp"), dims.dp), objective, t, 0, cpu, dp_group)
    times = []
    for step in range(1, t.steps):
        micro = batches(cfg, step, dims.rank("dp"), dims.dp)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, micro, objective, t, step, cpu, dp_group)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    summary = counter.summary()
    return {"layout": name, "world": dims.world_size, "step_s": step_s,
            "tokens_per_s": t.global_batch_size * t.seq_len / step_s,
            "bytes_per_step": {k: v["bytes"] for k, v in summary.items()},
            "calls_per_step": {k: v["calls"] for k, v in summary.items()},
            "optimizer_state_bytes_rank0": optimizer_state_bytes(opt)}


def worker(out: str, names: list[str], a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        rows = [measure(n, a) for n in names]
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up")
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1:], a)
        return
    names = [n for n in (a.only.split(",") if a.only else LAYOUTS) if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    torch.set_num_threads(1)
    base = measure("one", a)  # the baseline, in this process, in the same run
    rows = [base] if "one" in names else []
    by_world: dict[int, list[str]] = {}
    for n in names:
        if n != "one":
            by_world.setdefault(world_of(n), []).append(n)
    flags = ["--dim", str(a.dim), "--layers", str(a.layers), "--seq", str(a.seq), "--batch", str(a.batch),
             "--micro", str(a.micro), "--steps", str(a.steps)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for world, group in sorted(by_world.items()):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "benchmarks.parallel_layouts", *flags, "--worker", str(out), *group]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"world {world} layouts {group} failed:\n{proc.stderr[-4000:]}")
            rows += json.loads(out.read_text())
    ddp_bytes = {r["world"]: sum(r["bytes_per_step"].values()) for r in rows if r["layout"] == f"ddp{r['world']}"}
    for r in rows:
        r["speedup_vs_one"] = r["tokens_per_s"] / base["tokens_per_s"]
        total = sum(r["bytes_per_step"].values())
        if r["world"] in ddp_bytes and ddp_bytes[r["world"]]:
            r["bytes_vs_ddp"] = total / ddp_bytes[r["world"]]
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
