"""A pretraining job: the pieces of one run (data, model under its layout, optimizer, objective,
recovery, metrics) and the loop over optimizer steps, ending in the job's result."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.config.train import TrainConfig
from infra.launch.base import endpoint_for
from infra.launch.job import JobResult, JobSpec

from .activation_stats import ActivationStats
from .data import PackedLoader, split_rows, validation_batches
from .evaluation import evaluate
from .job_io import OutputFolder, fetch_input
from .meta_init import build_model
from .metrics import MetricsSink, flops_per_token, peak_flops, peak_memory_gb
from .objectives import LanguageModelling
from .parallel import ParallelDims, build_parallel_dims, parallelize
from .parallel.comm_accounting import StepComm
from .parallel.ddp import unwrap
from .parallel.mesh import pick_device
from .parallel.zero1 import build_parallel_optimizer
from .precision import autocast_for, check_fp8_device
from .recovery import Recovery
from .step import train_step
from .stragglers import Stragglers


class Trainer:
    """Holds the pieces of one job; `run()` trains `steps` optimizer steps. Checkpointing (issue 7)
    saves model, optimizer, `loader.state_dict()` and `step`."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.cfg = LifecycleConfig.model_validate(spec.config)
        self.train_cfg: TrainConfig = getattr(self.cfg, spec.section)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device, _ = pick_device(self.cfg.parallel.backend, self.cfg.infra.device)
        if self.train_cfg.precision == "fp8":  # refused here, in one line, before data or model are touched
            check_fp8_device(self.device, self.train_cfg.fp8.emulate)
        self.dims: ParallelDims = build_parallel_dims(self.cfg.parallel, self.device.type)
        self.dp_group = self.dims.group("dp")
        if self.rank == 0:
            print(f"trainer: {self.dims.world_size} rank(s) on {self.device.type}\n{self.dims.placement()}",
                  file=sys.stderr, flush=True)
        self.seed = self.train_cfg.seed if self.train_cfg.seed is not None else self.cfg.seed
        t = self.train_cfg
        if "tokens" not in spec.inputs:
            raise ValueError(f"job {spec.job_id}: inputs has no 'tokens' entry (got {sorted(spec.inputs)})")
        tokens_dir = fetch_input(spec.inputs["tokens"], spec.workdir, "tokens", endpoint_for(spec))
        if not (tokens_dir / "train").is_dir():
            raise FileNotFoundError(f"job input tokens={spec.inputs['tokens']}: no train/ split folder in {tokens_dir}")
        self.loader = PackedLoader(
            tokens_dir / "train", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size, dp_rank=self.dims.rank("dp"), dp_size=self.dims.dp, seed=self.seed,
            mixture=t.data_mixture,
        )
        self.val_batches = (
            validation_batches(tokens_dir / "val", seq_len=t.seq_len, batch_size=t.micro_batch_size,
                               max_batches=t.eval_batches, dp_rank=self.dims.rank("dp"), dp_size=self.dims.dp)
            if (tokens_dir / "val").is_dir() else []
        )
        self.model = parallelize(build_model(self.cfg), self.dims, self.cfg.parallel, t, device=self.device,
                                 seed=self.seed)
        self.optimizer = build_parallel_optimizer(unwrap(self.model), self.dims, self.cfg.parallel, t)
        self.comm = StepComm(self.dims, enabled=not t.compile)
        self.activations = ActivationStats(unwrap(self.model), self.cfg.model.n_layers, self.device) \
            if t.activation_stats else None
        self.objective = LanguageModelling(z_loss=self.cfg.model.z_loss, mtp_depth=self.cfg.model.mtp_depth,
                                           mtp_weight=t.mtp_loss_weight)
        if self.dims.cp > 1:  # each rank its zigzag share of every sequence; tokens agreed over dp x cp
            from .parallel.context_parallel import context_parallel_setup

            self.dp_group, self.objective = context_parallel_setup(self.dims, self.objective)
        self.output = OutputFolder(spec.output, spec.workdir, endpoint_for(spec), writer=self.rank == 0)
        self.step = 0
        self.flops_per_token = flops_per_token(self.cfg.model, t.seq_len)
        self.peak_flops = t.peak_flops or peak_flops(self.device, t.precision)
        # Pre-flight, checkpoints (resume: latest), spike guard, faults: trainer/recovery.py
        self.recovery = Recovery(self)
        self.recovery.faults.slow_down(unwrap(self.model))  # a straggler drill (trainer/faults.py), when asked
        self.stragglers = Stragglers(unwrap(self.model), self.device, enabled=t.straggler_detection)

    def run(self) -> JobResult:
        t = self.train_cfg
        sink = MetricsSink(self.output.path, self.spec.tracking.uri, self.spec.tracking.run_id,
                           total_steps=t.steps, enabled=self.rank == 0, sync=self.output.sync,
                           system_metrics_s=self.cfg.infra.system_metrics_s)
        sink.log_params({"flops_per_token": self.flops_per_token, "peak_flops": self.peak_flops,
                         "world_size": self.dims.world_size})
        if self.rank == 0:
            sink.log_params(self._estimate_vs_measured())
        speeds: list[float] = []
        last: dict[str, float] = {}
        status, message = "completed", ""
        try:
            while self.step < t.steps:
                micro = self.recovery.next_batch()
                logged = (self.step + 1) % t.log_every == 0 or self.step + 1 == t.steps
                if logged and self.activations is not None:
                    self.activations.start()
                t0 = time.perf_counter()
                # collectives per mesh dimension (parallel/comm_accounting.py); this rank's compute time
                with self.comm.count(), self.stragglers.step():
                    res = train_step(self.model, self.optimizer, micro, self.objective, t, self.step, self.device,
                                     self.dp_group,
                                     before_update=self.recovery.before_update if t.spike.enabled else None)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.perf_counter() - t0
                acts = self.activations.finish() if logged and self.activations is not None else {}
                self.step += 1
                tokens_per_s = t.global_batch_size * t.seq_len / dt
                if self.step > 1 or t.steps == 1:
                    speeds.append(tokens_per_s)
                last = {
                    # the LR applied: the schedule's, times the spike guard's scale after rollbacks
                    "loss": res.loss, "grad_norm": res.grad_norm,
                    "lr": res.lr * (self.recovery.lr_scale if t.spike.enabled else 1.0), "tokens_per_s": tokens_per_s,
                    "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.dims.world_size),
                    "peak_memory_gb": peak_memory_gb(self.device), "epoch": self.loader.epoch, **res.moe, **res.mtp,
                    **self.comm.metrics, **self.stragglers.exchange(logged),  # every rank: a collective
                }
                if self.cfg.model.z_loss > 0:
                    last["z_loss"] = res.z_loss
                if res.moe:
                    last["aux_loss"] = res.aux_loss
                if not math.isfinite(res.loss) and res.applied:
                    status, message = "diverged", f"loss is {res.loss} at step {self.step}"
                    break
                verdict = self.recovery.after_step(res, sink)
                if verdict == "diverged":
                    status, message = "diverged", self.recovery.message
                    break
                if verdict == "rolled_back":
                    continue
                if logged:
                    sink.log({**last, **acts}, self.step)
                if self.val_batches and t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                    sink.log({"val_loss": self._evaluate()}, self.step)
                sink.log_checkpoints(self.recovery.take_committed(), self.spec.stage)
                sink.advance()
            if status == "completed" and self.val_batches:
                last["val_loss"] = self._evaluate()
                sink.log({"val_loss": last["val_loss"]}, self.step)
            checkpoint = self.recovery.finish(status)
            last.update(self.recovery.metrics())
        finally:
            sink.log_checkpoints(self.recovery.take_committed(), self.spec.stage)  # the final one, at least
            sink.close()
            self.recovery.close()
            if self.activations is not None:
                self.activations.close()
        if speeds:
            last["tokens_per_s"] = statistics.median(speeds)
            last["mfu"] = self.flops_per_token * last["tokens_per_s"] / (self.peak_flops * self.dims.world_size)
        return JobResult(status=status, steps=self.step, metrics=last, message=message, checkpoint=checkpoint,
                         skip_windows=self.recovery.skip_windows, resumed_from_step=self.recovery.resumed_from)

    def _estimate_vs_measured(self) -> dict[str, float]:
        """The estimator's figures (trainer/estimate) next to what torch's FLOP counter measures on this
        model, so MLflow shows them side by side. Counted on one process only: a counting backward
        under DDP/FSDP would fire gradient collectives on this rank alone."""
        from .estimate import count_model_flops
        from .estimate.run import estimate_run, tracking_params

        figures = tracking_params(estimate_run(self.cfg))
        if self.dims.world_size == 1:
            ids = self.loader.step_rows(self.loader.next_sample)  # the next step's rows, not consumed
            b = self.train_cfg.micro_batch_size
            with autocast_for(self.train_cfg.precision, self.device):  # as the step multiplies (a bf16 MoE
                # combines in fp32 and needs autocast to multiply that back with bf16 weights)
                micro = count_model_flops(unwrap(self.model), split_rows(self.loader.shards, ids[:b]))
            figures["measured.flops_per_step"] = float(micro * (len(ids) // b))
        return figures

    def _evaluate(self) -> float:
        # the main model's validation loss: the MTP depths (training signal only) are not run
        objective = (dataclasses.replace(self.objective, mtp_depth=0)
                     if isinstance(self.objective, LanguageModelling) else self.objective)
        return evaluate(self.model, self.val_batches, objective, self.train_cfg.precision, self.device,
                        self.dp_group)
