"""State bytes per rank, wire bytes per step per mesh dimension, and step time of each parallel layout,
each measured on CPU with gloo beside what `eightfold estimate` gives for the same config.

The layouts are a table (LAYOUTS: name -> parallel: overrides); every layout of one world size runs
inside one torchrun launch (this file is also the worker), on the same model, global batch and seed,
and the one-process layout is measured in the same run as the baseline. Each layout: one warm-up
step (the masters and moments are made lazily, the pipeline infers its shapes), one step whose
collectives are counted (trainer.parallel.comm_accounting) and at whose zero_grad rank 0's state is
walked (trainer.parallel.state_accounting), then `--steps` timed steps (median). One JSON line per
layout:

    {"layout": "zero1_dp2", "precision": "bf16", "world": 2,
     "state_bytes_rank0": ..., "estimated_state_bytes_rank0": ..., "state_ratio": ...,
     "state_breakdown_rank0": {"weights", "grads", "masters", "moments"},
     "named_buffers_rank0": {"zero1_grad_shards", "master_grads", "buffers"},   (not in the state)
     "wire_bytes_per_step": {"dp": ...}, "estimated_wire_bytes_per_step": {"dp": ...}, "wire_ratio": {"dp": ...},
     "calls_per_step": ..., "step_s": ..., "tokens_per_s": ..., "speedup_vs_one": ..., "bytes_vs_ddp": ...}

Rank 0 is pipeline stage 0, tensor/context/expert rank 0; the estimate is taken for that stage. Wire
bytes are keyed by the group that carries them (gradient sync: dp, or cp / dp_cp under context
parallel, dp_shard + dp_replicate under HSDP). On one 2-core machine several ranks share the cores,
so the times show communication and framework overhead, not the scaling a GPU cluster would give;
the bytes are exact.

    python -m benchmarks.parallel_layouts [--precision bf16,fp32 --dim 64 --layers 2 --seq 64 --steps 4 --only tp2,zero1_dp2]

`--precision bf16,fp32` measures every layout in both, in the same launches (rows by precision, then layout).
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
from trainer.meta_init import build_model
from trainer.objectives import LanguageModelling
from trainer.parallel.ddp import unwrap
from trainer.step import train_step
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.comm_accounting import CommCounter
from trainer.estimate.run import estimate_run
from trainer.parallel.state_accounting import STATE, measure_at_zero_grad
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
    # Expert parallel reuses the data-parallel ranks; its model is an MoE (MOE_LAYOUTS).
    "ep2": {"dp": 2, "ep": 2},
}
# Layouts run on the MoE variant of the model: every layer 4 experts, top-2, capacity 1.25 (overflow dropped),
# each expert padded to its capacity, so the all-to-all's bytes are fixed by the config rather than by how
# the untrained router happens to split the tokens (model.moe.pad_to_capacity).
MOE_LAYOUTS = {"ep2"}
MOE = {"num_experts": 4, "top_k": 2, "capacity_factor": 1.25, "pad_to_capacity": True}


def world_of(name: str) -> int:
    p = LAYOUTS[name]
    return p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1)


def config(name: str, a: argparse.Namespace) -> LifecycleConfig:
    vocab = 512
    return LifecycleConfig.model_validate({
        "name": "parallel-bench", "seed": 0,
        "model": {"vocab_size": vocab, "dim": a.dim, "n_layers": a.layers, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_dim": 4 * a.dim, "max_seq_len": a.seq, "moe": MOE if name in MOE_LAYOUTS else None},
        "tokenizer": {"vocab_size": vocab},
        "parallel": {"nproc_per_node": world_of(name), **LAYOUTS[name]},
        "pretrain": {"steps": a.steps + 2, "seq_len": a.seq, "micro_batch_size": a.micro,
                     "global_batch_size": a.batch, "lr": 1e-3, "warmup_steps": 0, "precision": a.precision,
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


def estimated_rank0(cfg: LifecycleConfig, dims) -> tuple[dict, dict]:
    """`eightfold estimate` on the same config, for global rank 0 (pipeline stage 0): its state bytes
    (weights, grads, optimizer) and the bytes it sends per step, keyed by the groups the counter names."""
    stage = estimate_run(cfg)["stages"][0]
    state = {k: stage["bytes"][k] for k in ("weights", "grads", "optimizer")}
    comm = stage["comm_bytes"]
    names = dims.group_names()
    wire: dict[str, float] = {}

    def add(dim: str, nbytes: float) -> None:
        if nbytes:
            wire[dim] = wire.get(dim, 0.0) + nbytes

    if cfg.parallel.zero >= 2 and dims.dp_replicate > 1:  # HSDP: shard group, and the replicas' all-reduce
        add("dp_shard", comm["dp"] - comm["hsdp"])
        add("dp_replicate", comm["hsdp"])
    elif comm["dp"]:
        from trainer.parallel.mesh import data_context_group

        add(names[data_context_group(dims).group_name], comm["dp"])  # dp, cp or dp_cp: who holds the same weights
    for dim in ("tp", "pp", "cp", "ep"):
        add(dim, comm[dim])
    return state, wire


def ratios(measured: dict, estimated: dict) -> dict:
    return {k: (measured.get(k, 0.0) / estimated[k] if estimated.get(k) else None)
            for k in sorted(set(measured) | set(estimated))}


def measure(name: str, a: argparse.Namespace) -> dict:
    """One layout: a warm-up step (masters and moments are made lazily, the pipeline infers shapes), then
    one step whose collectives are counted and whose state is measured on this rank before zero_grad,
    then `--steps` timed steps. State and wire bytes beside the estimator's for the same config."""
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
    names = dims.group_names()
    if dims.ep > 1:  # the mesh's ep dimension, which group_names leaves to its ranks' match (dp on ep2)
        names[dims.group("ep").group_name] = "ep"

    def step(i: int) -> None:
        train_step(model, opt, batches(cfg, i, dims.rank("dp"), dims.dp), objective, t, i, cpu, dp_group)

    step(0)
    state: dict = {}
    measure_at_zero_grad(opt, state, unwrap(model))
    with CommCounter(names) as counter:
        step(1)
    times = []
    for i in range(2, 2 + a.steps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times) if times else None
    summary = counter.summary()
    wire = {k: v["bytes"] for k, v in summary.items()}
    est_state, est_wire = estimated_rank0(cfg, dims)
    measured_state, estimated_state = state["state"], sum(est_state.values())
    return {"layout": name, "precision": t.precision, "world": dims.world_size, "step_s": step_s,
            "tokens_per_s": t.global_batch_size * t.seq_len / step_s if step_s else None,
            "state_bytes_rank0": measured_state, "estimated_state_bytes_rank0": estimated_state,
            "state_ratio": measured_state / estimated_state,
            "state_breakdown_rank0": {k: state[k] for k in STATE},
            "estimated_state_breakdown_rank0": est_state,
            "named_buffers_rank0": {k: state[k] for k in ("zero1_grad_shards", "master_grads", "buffers")},
            "wire_bytes_per_step": wire, "estimated_wire_bytes_per_step": est_wire,
            "wire_ratio": ratios(wire, est_wire),
            "calls_per_step": {k: v["calls"] for k, v in summary.items()},
            "optimizer_state_bytes_rank0": optimizer_state_bytes(opt)}


def each_precision(a: argparse.Namespace) -> list[argparse.Namespace]:
    """The arguments once per precision of `--precision` (one, or a comma-separated list)."""
    return [argparse.Namespace(**{**vars(a), "precision": p}) for p in a.precision.split(",")]


def worker(out: str, names: list[str], a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        rows = [measure(n, ap) for ap in each_precision(a) for n in names]
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def precisions(text: str) -> str:
    names = [p for p in text.split(",") if p]
    bad = [p for p in names if p not in ("bf16", "fp32")]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--precision {text!r}: bf16, fp32 or bf16,fp32")
    return ",".join(names)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps after a warm-up and a counted step")
    p.add_argument("--precision", type=precisions, default="bf16",
                   help="bf16, fp32, or both comma-separated (one launch per world size measures both)")
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    return p


def run_layouts(names: list[str], a: argparse.Namespace) -> list[dict]:
    """Measure the multi-process layouts `names` in every precision of `a.precision`: one torchrun launch per
    world size (its ranks import torch once for all of them); rows in launch order, by precision then layout."""
    by_world: dict[int, list[str]] = {}
    for n in names:
        by_world.setdefault(world_of(n), []).append(n)
    flags = ["--dim", str(a.dim), "--layers", str(a.layers), "--seq", str(a.seq), "--batch", str(a.batch),
             "--micro", str(a.micro), "--steps", str(a.steps), "--precision", a.precision]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rows: list[dict] = []
    for world, group in sorted(by_world.items()):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "benchmarks.parallel_layouts", *flags, "--worker", str(out), *group]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"world {world} layouts {group} failed:\n{proc.stderr[-4000:]}")
            rows += json.loads(out.read_text())
    return rows


def main() -> None:
    a = parser().parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1:], a)
        return
    names = [n for n in (a.only.split(",") if a.only else LAYOUTS) if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    torch.set_num_threads(1)
    base = {ap.precision: measure("one", ap) for ap in each_precision(a)}  # baselines, in this process, same run
    rows = ([*base.values()] if "one" in names else []) + run_layouts([n for n in names if n != "one"], a)
    ddp_bytes = {(r["precision"], r["world"]): sum(r["wire_bytes_per_step"].values()) for r in rows
                 if r["layout"] == f"ddp{r['world']}"}
    for r in rows:
        one = base[r["precision"]]
        if r["tokens_per_s"] and one["tokens_per_s"]:
            r["speedup_vs_one"] = r["tokens_per_s"] / one["tokens_per_s"]
        total = sum(r["wire_bytes_per_step"].values())
        ddp = ddp_bytes.get((r["precision"], r["world"]))
        if ddp:
            r["bytes_vs_ddp"] = total / ddp
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
