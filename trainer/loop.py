"""The one training loop. An objective supplies the loss of a micro-batch (language modelling here;
SFT, DPO and GRPO plug in later); the loop owns accumulation, clipping, the optimizer step, the
schedule, evaluation, metrics and result.json.

Step (seed: "A replica is responsible for 8 sequences per step but processes only 2 at a time"):
every micro-batch's summed loss is divided by the number of target tokens in the whole step (all
micro-batches, all data-parallel ranks), so the accumulated gradient is that of the token-weighted
mean over the global batch, whatever the split into micro-batches and ranks.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from infra.config import LifecycleConfig
from infra.config.train import TrainConfig
from infra.launch.base import endpoint_for, write_result
from infra.launch.job import JobResult, JobSpec

from .activation_stats import ActivationStats
from .data import MicroBatch, PackedLoader, split_rows, validation_batches
from .job_io import OutputFolder, fetch_input
from .loss import IGNORE_INDEX, HeadLoss, TokenLoss, moe_aux_loss, moe_layers
from .metrics import MetricsSink, flops_per_token, measure_peak_flops, peak_memory_gb
from .model import Transformer
from .model.moe import imbalance
from .optim import clip_grad_norm, lr_at, set_lr
from .parallel import ParallelDims, build_parallel_dims, parallelize
from .parallel.comm_accounting import StepComm
from .parallel.fsdp import skip_grad_sync
from .parallel.materialize import materialize
from .parallel.mesh import pick_device, process_group_args
from .parallel.zero1 import DistributedOptimizer, build_parallel_optimizer
from .precision import autocast_for
from .recovery import Recovery, attempt_store
from .stragglers import Stragglers


class Objective(Protocol):
    """What a training method supplies: how many loss units (target tokens, pairs ...) a micro-batch
    holds, known before the forward so the step's normaliser can be agreed on first, and the summed
    loss of one micro-batch."""

    def weight(self, batch: MicroBatch) -> int: ...

    def loss(self, model: nn.Module, batch: MicroBatch, device: torch.device) -> TokenLoss: ...


@dataclass
class LanguageModelling:
    """Next-token prediction: inputs row[:-1], targets row[1:] (seed: "the target sequence is the input
    shifted one position left")."""

    z_loss: float = 0.0

    def weight(self, batch: MicroBatch) -> int:
        return int((batch.targets != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: MicroBatch, device: torch.device) -> TokenLoss:
        # The LM head runs fused with the loss when it can (trainer/loss.py HeadLoss): no full logits.
        targets = batch.targets.to(device, non_blocking=True)
        return model(batch.inputs.to(device, non_blocking=True), head=HeadLoss(targets, z_loss=self.z_loss))


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@dataclass
class StepResult:
    loss: float  # token-weighted mean cross-entropy over the global batch
    grad_norm: float  # before clipping
    lr: float
    tokens: int  # target tokens over the global batch
    z_loss: float = 0.0
    aux_loss: float = 0.0
    moe: dict[str, float] = field(default_factory=dict)
    applied: bool = True  # False when the spike guard skipped the optimizer step (trainer.recovery)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    objective: Objective,
    cfg: TrainConfig,
    step: int,
    device: torch.device,
    dp_group=None,
    before_update=None,
) -> StepResult:
    """One optimizer step over this rank's micro-batches (see the module docstring)."""
    if getattr(unwrap(model), "pipeline", None) is not None:  # pipeline parallel: the schedule runs the passes
        from .parallel.pipeline import pipeline_train_step

        return pipeline_train_step(unwrap(model), optimizer, micro_batches, objective, cfg, step, device, dp_group,
                                   before_update)
    model.train()
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    n_micro = len(micro_batches)
    tokens = torch.tensor(float(sum(objective.weight(mb) for mb in micro_batches)), device=device)
    if dp_group is not None:
        dist.all_reduce(tokens, group=dp_group)
    # DDP averages gradients over ranks; multiplying by dp_size turns that average into the sum.
    scale = dp_size / tokens.clamp_min(1.0)
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    inner = unwrap(model)
    moes = moe_layers(inner)
    loads = [torch.zeros(m.num_experts, device=device) for m in moes]
    dropped = torch.zeros(len(moes), device=device)
    sums = torch.zeros(3, device=device)  # ce, z, aux
    for i, mb in enumerate(micro_batches):
        last = i == n_micro - 1
        sync = contextlib.nullcontext() if last else skip_grad_sync(model)  # DDP no_sync / FSDP2
        with sync:
            with autocast_for(cfg.precision, device):
                part = objective.loss(model, mb, device)
            loss = part.total * scale
            aux = moe_aux_loss(inner)
            if aux is not None:
                loss = loss + aux / n_micro  # mean over micro-batches (and over ranks, by DDP)
            if last and isinstance(optimizer, DistributedOptimizer):
                optimizer.start_grad_sync_after(1)  # ZeRO-1: each bucket reduce-scatters once this backward fills it
            loss.backward()
        sums += torch.stack([part.ce_sum.detach(), part.z_sum.detach(),
                             aux.detach() / n_micro if aux is not None else torch.zeros((), device=device)])
        for j, m in enumerate(moes):
            loads[j] += m.tokens_per_expert.float()
            dropped[j] += m.dropped_fraction / n_micro
    if isinstance(optimizer, DistributedOptimizer):  # ZeRO-1: reduce-scatter, then the norm over shards
        grad_norm = optimizer.clip_grad_norm(cfg.grad_clip)
    else:
        norm_plan = getattr(inner, "grad_norm_plan", None)  # set when a rank holds part of the parameters (EP)
        grad_norm = (clip_grad_norm(model.parameters(), cfg.grad_clip) if norm_plan is None
                     else norm_plan.clip(model.parameters(), cfg.grad_clip))
    # before_update(ce_sum, tokens, grad_norm) -> bool: the spike guard may skip this update.
    applied = before_update is None or before_update(sums[0], tokens, grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    if dp_group is not None:  # one all-reduce for the logged sums and every MoE layer's load
        packed = torch.cat([sums, *loads])
        dist.all_reduce(packed, group=dp_group)
        sums = packed[:3]
        loads = list(packed[3:].split([m.num_experts for m in moes])) if moes else []
    moe_stats: dict[str, float] = {}
    if moes:
        for m, load in zip(moes, loads):
            if m.balance == "bias":
                m.update_bias(load)  # the same summed load on every rank keeps the biases identical
        moe_stats = {
            "moe_imbalance": statistics.fmean(imbalance(load) for load in loads),
            "moe_dropped": float(dropped.mean()),  # this rank's micro-batches
        }
    total_tokens = float(tokens)
    return StepResult(
        loss=float(sums[0]) / max(total_tokens, 1.0),
        grad_norm=float(grad_norm),
        lr=lr,
        tokens=int(total_tokens),
        z_loss=float(sums[1]) / max(total_tokens, 1.0),
        aux_loss=float(sums[2]) / dp_size,
        moe=moe_stats,
        applied=applied,
    )


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[MicroBatch], objective: Objective, precision: str,
             device: torch.device, dp_group=None) -> float:
    """Token-weighted mean validation cross-entropy over every rank's batches."""
    if getattr(unwrap(model), "pipeline", None) is not None:
        from .parallel.pipeline import pipeline_evaluate

        return pipeline_evaluate(unwrap(model), batches, objective, device, precision)
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device)
    for mb in batches:
        with autocast_for(precision, device):
            part = objective.loss(model, mb, device)
        sums += torch.stack([part.ce_sum.float(), part.tokens.float()])
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
    model.train(was_training)
    return float(sums[0] / sums[1].clamp_min(1.0))


def build_model(cfg: LifecycleConfig, device: torch.device | None = None, seed: int | None = None) -> Transformer:
    """The whole model on the meta device: shapes, no memory. `parallelize(..., device=, seed=)` then
    applies the layout's plans to it and each rank allocates and initialises only its own share, with
    the values one process would hold there (trainer/parallel/materialize.py), so every layout starts
    from the same weights. Given a device and a seed: that one-process model, materialised whole."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if device is not None:
        if seed is None:
            raise ValueError("build_model: a device without a seed; the initial weights need both")
        materialize(model, device, seed)
    return model


class Trainer:
    """Holds the pieces of one job; `run()` trains `steps` optimizer steps. Checkpointing (issue 7)
    saves model, optimizer, `loader.state_dict()` and `step`."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.cfg = LifecycleConfig.model_validate(spec.config)
        self.train_cfg: TrainConfig = getattr(self.cfg, spec.section)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device, _ = pick_device(self.cfg.parallel.backend, self.cfg.infra.device)
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
        self.objective = LanguageModelling(z_loss=self.cfg.model.z_loss)
        if self.dims.cp > 1:  # each rank its zigzag share of every sequence; tokens agreed over dp x cp
            from .parallel.context_parallel import context_parallel_setup

            self.dp_group, self.objective = context_parallel_setup(self.dims, self.objective)
        self.output = OutputFolder(spec.output, spec.workdir, endpoint_for(spec))
        self.step = 0
        self.flops_per_token = flops_per_token(self.cfg.model, t.seq_len)
        dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
        self.peak_flops = t.peak_flops or measure_peak_flops(self.device, dtype)
        # Pre-flight, checkpoints (resume: latest), spike guard, faults: trainer/recovery.py
        self.recovery = Recovery(self)
        self.recovery.faults.slow_down(unwrap(self.model))  # a straggler drill (trainer/faults.py), when asked
        self.stragglers = Stragglers(unwrap(self.model), self.device, enabled=t.straggler_detection)

    def run(self) -> JobResult:
        t = self.train_cfg
        sink = MetricsSink(self.output.path, self.spec.tracking.uri, self.spec.tracking.run_id,
                           total_steps=t.steps, enabled=self.rank == 0)
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
                    "peak_memory_gb": peak_memory_gb(self.device), "epoch": self.loader.epoch, **res.moe,
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
                sink.advance()
            if status == "completed" and self.val_batches:
                last["val_loss"] = self._evaluate()
                sink.log({"val_loss": last["val_loss"]}, self.step)
            checkpoint = self.recovery.finish(status)
            last.update(self.recovery.metrics())
        finally:
            sink.close()
            self.recovery.close()
            if self.activations is not None:
                self.activations.close()
        if speeds:
            last["tokens_per_s"] = statistics.median(speeds)
            last["mfu"] = self.flops_per_token * last["tokens_per_s"] / (self.peak_flops * self.dims.world_size)
        return JobResult(status=status, steps=self.step, metrics=last, message=message, checkpoint=checkpoint,
                         skip_windows=self.recovery.skip_windows)

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
            micro = count_model_flops(unwrap(self.model), split_rows(self.loader.shards, ids[:b]))
            figures["measured.flops_per_step"] = float(micro * (len(ids) // b))
        return figures

    def _evaluate(self) -> float:
        return evaluate(self.model, self.val_batches, self.objective, self.train_cfg.precision, self.device,
                        self.dp_group)


def init_distributed(cfg: LifecycleConfig) -> None:
    """Join the process group torchrun describes (nothing to do for one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    device, backend = pick_device(cfg.parallel.backend, cfg.infra.device)
    args = process_group_args(cfg.parallel, backend, device)  # every later group copies its timeout
    store = attempt_store(max(args["timeout"], timedelta(seconds=60)))  # torchrun restarts: per-attempt keys
    if store is None:
        dist.init_process_group(**args)
    else:
        dist.init_process_group(**args, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


def finish(spec: JobSpec, output: OutputFolder, result: JobResult) -> None:
    """Upload the output folder (if remote), then write result.json last: its presence means done."""
    output.publish()
    write_result(spec, result)


def run_job(job_file: str) -> int:
    """The `python -m trainer JOB.yaml` entry point: train, then rank 0 writes result.json. Returns the
    process exit code (0 completed, 1 failed, 2 diverged)."""
    spec = JobSpec.read(job_file)
    cfg = LifecycleConfig.model_validate(spec.config)
    init_distributed(cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    output = OutputFolder(spec.output, spec.workdir, endpoint_for(spec)) if rank == 0 else None
    try:
        if spec.section.startswith("posttrain."):  # SFT / DPO / GRPO objectives: trainer/posttrain_job.py
            from .posttrain_job import PosttrainJob

            result = PosttrainJob(spec).run()
        else:
            result = Trainer(spec).run()
    except Exception as exc:  # result.json says why, then the launcher sees a non-zero exit
        traceback.print_exc()
        if output is not None:
            finish(spec, output, JobResult(status="failed", message=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if output is not None:
        finish(spec, output, result)
        print(f"trainer: {result.status} after {result.steps} steps: "
              + ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()), file=sys.stderr)
    return {"completed": 0, "failed": 1, "diverged": 2}[result.status]
