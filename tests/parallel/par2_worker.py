"""Run under torchrun by test_par2_layouts.py: every layout of one world size in one launch.

argv: PLAN.json OUT_DIR. The plan is a list of {"name", "job", "mode"}; mode "train" trains the job's
steps through the real Trainer and saves, per rank, the losses, the rank's own weights (full-model
names) and its optimizer-state bytes; mode "bubble" also instruments the pipeline with a
PipelineTrace (fixed delays per pass) and saves each rank's idle fraction, the order of its passes and
its peak live micro-batches.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from trainer.parallel.ddp import unwrap
from trainer.process_group import init_distributed
from trainer.step import train_step
from trainer.trainer import Trainer


ACTS_STEP = 1  # the step whose per-layer activation statistics are recorded (trainer/activation_stats.py)


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of a weight (a tensor-parallel DTensor is gathered over its tp group)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run(job_file: str, mode: str, out: Path) -> None:
    spec = JobSpec.read(job_file)
    tr = Trainer(spec)
    model = unwrap(tr.model)
    trace = None
    if mode == "bubble":
        from trainer.parallel.pipeline_trace import PipelineTrace

        trace = PipelineTrace(delay_s=(0.02, 0.04))
        model.pipeline.instrument(trace)
    losses, norms, idle, peaks, orders = [], [], [], {}, []
    for step in range(tr.train_cfg.steps):
        if trace is not None:
            trace.reset()
        if step == ACTS_STEP:
            tr.activations.start()
        res = train_step(tr.model, tr.optimizer, tr.loader.next_step(), tr.objective, tr.train_cfg, step,
                         tr.device, tr.dp_group)
        if step == ACTS_STEP:
            acts = tr.activations.finish()
        losses.append(res.loss)
        norms.append(res.grad_norm)
        if trace is not None and step > 0:  # step 0 includes the schedule's set-up
            idle.append(trace.idle_fraction())
            # the passes in the order this rank ran them: the schedule itself, free of the machine's timing
            orders.append([(kind, stage, mb) for kind, stage, mb, _, _ in sorted(trace.events, key=lambda e: e[3])])
            for s, n in trace.peak_live.items():
                peaks[s] = max(peaks.get(s, 0), n)
    from trainer.parallel.context_parallel import ring_tiles_computed
    from trainer.parallel.zero1 import local, optimizer_state_bytes

    record = {"losses": losses, "grad_norms": norms, "acts": acts, "n_layers": tr.cfg.model.n_layers,
              "state": {k: full(v) for k, v in model.state_dict().items()},
              "tiles": ring_tiles_computed(model), "idle": idle, "orders": orders, "peak_live": peaks, "moe": res.moe,
              "pp_rank": tr.dims.rank("pp"), "cp_rank": tr.dims.rank("cp"), "dp_rank": tr.dims.rank("dp"),
              "tp_rank": tr.dims.rank("tp"), "state_bytes": optimizer_state_bytes(tr.optimizer),
              "local_params": sum(local(p).numel() for p in model.parameters())}
    if getattr(model, "pipeline", None) is not None:
        record["chunks"] = model.pipeline.chunk_ids
        record["counts"] = model.pipeline.counts
    record["val_loss"] = tr._evaluate() if tr.val_batches else None
    torch.save(record, out)


def main(plan_file: str, out_dir: str) -> None:
    plan = json.loads(Path(plan_file).read_text())
    init_distributed(LifecycleConfig.model_validate(JobSpec.read(plan[0]["job"]).config))
    rank = dist.get_rank()
    for item in plan:
        run(item["job"], item.get("mode", "train"), Path(out_dir) / f"{item['name']}.rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
