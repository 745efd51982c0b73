"""Pipeline parallel: the layers are cut into stages, one (or, interleaved, several) per pp rank, and
micro-batches flow through them under a schedule from `torch.distributed.pipelining` (seed: "the
last stage gets fewer layers" because it also holds the LM head and the loss).

- The split: `parallel.pp_split` (layers per chunk, uneven allowed) or `auto`, which balances the
  estimated FLOPs of every chunk with the head's 6*V*D per token counted on the last
  (trainer.estimate.formulas.split_layers).
- A stage is the same Transformer class holding a subset of the layers (TorchTitan's approach): the
  first keeps `embed_tokens`, the last `norm` and `lm_head`, the others take and return hidden states.
  The rank's local model keeps exactly the parameters of its chunks under their full-model names, so
  optimizer and checkpoint code see an ordinary module.
- Chunks per rank: loop style (rank r holds chunks r, r+p, ...) for GPipe, 1F1B and interleaved
  1F1B/zero-bubble; V style (rank r holds r and 2p-1-r) for ZBV and DualPipeV.
- Exact accumulation: the loss of a micro-batch on the last stage is its summed cross-entropy times
  D / (target tokens of the whole global batch), D the data-parallel x cp size; the schedule adds the
  micro-batches' gradients unscaled (scale_grads=False), data parallel averages over D, so the step's
  gradient is that of the token-weighted mean, as in `trainer.loop.train_step`.
- The gradient norm for clipping is global: squared norms are summed over the pp ranks.
- Data parallel: a bucketed all-reduce of the stage's gradients over dp x cp (grad_all_reduce.py), or,
  under ZeRO-1 (`zero1.DistributedOptimizer`), its reduce-scatter / sharded step / all-gather over the
  same group (the seed's layout: dp=2 x tp=2 x pp=2 with ZeRO-1). Either way a bucket starts reducing
  as soon as the stage's last micro-batch backward has produced its gradients, during the schedule's
  cooldown (hooks counting m backward passes per parameter), and the step waits after the schedule.
  Under ZeRO-2/3 the stage modules are FSDP2 roots and the schedule reduce-scatters after each stage's
  last micro-batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from infra.config.parallel import ParallelConfig
from infra.config.train import TrainConfig

from ..estimate import formulas
from ..model import Transformer
from .grad_all_reduce import GradAllReduce
from .grad_norm import GradNormPlan
from .mesh import ParallelDims
from .zero1 import DistributedOptimizer

V_STYLE = ("zbv", "dualpipev")


def schedule_class(name: str):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    table = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
    if name not in table:
        raise ValueError(f"parallel.pp_schedule={name!r}; expected one of {', '.join(table)}")
    return table[name]


# ------------------------------------------------------------------------------------------ the split


def chunk_layer_counts(model_cfg, parallel: ParallelConfig, seq_len: int) -> list[int]:
    """Layers per pipeline chunk (pp * virtual stages chunks), from the config or balanced on FLOPs."""
    chunks = parallel.pp * parallel.pp_virtual_stages
    if isinstance(parallel.pp_split, list):
        counts = list(parallel.pp_split)
        if len(counts) != chunks or sum(counts) != model_cfg.n_layers or min(counts) < 1:
            raise ValueError(f"parallel.pp_split={counts}: need {chunks} chunks of >= 1 layer summing to "
                             f"model.n_layers={model_cfg.n_layers}")
        return counts
    q_dim = model_cfg.n_heads * model_cfg.head_size
    # Per token: 6 x active layer parameters + attention (12 s q_dim); the head 6 V D on the last chunk.
    costs = [6 * x["active"] + 12 * seq_len * q_dim for x in formulas.model_layer_params(model_cfg)]
    return formulas.split_layers(costs, chunks, last_extra=6 * model_cfg.vocab_size * model_cfg.dim)


def chunks_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule in V_STYLE:
        if virtual != 2:
            raise ValueError(f"pp_schedule={schedule} needs pp_virtual_stages=2, got {virtual}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def stage_module(model: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """A Transformer holding the given layers of `model` (shared, not copied)."""
    part = Transformer.__new__(Transformer)
    nn.Module.__init__(part)
    part.cfg = model.cfg
    part.embed_tokens = model.embed_tokens if first else None
    part.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    part.norm = model.norm if last else None
    part.lm_head = model.lm_head if last else None
    return part


# ------------------------------------------------------------------------------------ measurement


@dataclass
class PipelineTrace:
    """Timestamps of every forward/backward this rank ran, and the live micro-batches per chunk.

    `delay_s` = (forward, backward) seconds added to each pass of a whole-model-sized chunk (divided
    by the chunks per rank), so a measurement reflects the schedule's dependencies rather than a
    busy machine's noise; (0, 0) measures the real passes."""

    delay_s: tuple[float, float] = (0.0, 0.0)
    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # kind, stage, mb, t0, t1
    live: dict[int, int] = field(default_factory=dict)
    peak_live: dict[int, int] = field(default_factory=dict)
    window: tuple[float, float] = (0.0, 0.0)

    def reset(self) -> None:
        self.events.clear()
        self.live.clear()
        self.peak_live.clear()

    def idle_fraction(self) -> float:
        t0, t1 = self.window
        busy = sum(e[4] - e[3] for e in self.events)
        return 1.0 - busy / (t1 - t0) if t1 > t0 else 0.0


def _instrument(stage, trace: PipelineTrace, chunks_per_rank: int) -> None:
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
    bwd_w = getattr(stage, "backward_weight_one_chunk", None)
    sid = stage.stage_index
    f_delay, b_delay = (d / chunks_per_rank for d in trace.delay_s)

    def forward_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.perf_counter()
        out = fwd(chunk_id, *args, **kwargs)
        if f_delay:
            time.sleep(f_delay)
        trace.events.append(("F", sid, chunk_id, t0, time.perf_counter()))
        trace.live[sid] = trace.live.get(sid, 0) + 1
        trace.peak_live[sid] = max(trace.peak_live.get(sid, 0), trace.live[sid])
        return out

    def backward_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.perf_counter()
        out = bwd(chunk_id, *args, **kwargs)
        if b_delay:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            time.sleep(b_delay if full else b_delay / 2)  # input-only backward: the W pass does the rest
        trace.events.append(("B", sid, chunk_id, t0, time.perf_counter()))
        trace.live[sid] -= 1
        return out

    def backward_weight_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.perf_counter()
        out = bwd_w(chunk_id, *args, **kwargs)
        if b_delay:
            time.sleep(b_delay / 2)
        trace.events.append(("W", sid, chunk_id, t0, time.perf_counter()))
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    if bwd_w is not None:
        stage.backward_weight_one_chunk = backward_weight_one_chunk


# -------------------------------------------------------------------------------------- the pipeline


class Pipeline:
    """This rank's stages, the schedule and the groups a pipeline step needs. Attached to the local
    model as `model.pipeline` (a plain attribute: not a submodule, not in the state dict)."""

    def __init__(self, parts, stages, schedule, pp_group, data_group, chunk_ids, counts, schedule_name,
                 z_loss: float, skip_sync: set[int]):
        self.parts, self.stages, self.schedule = parts, stages, schedule
        self.pp_group, self.data_group = pp_group, data_group
        self.chunk_ids, self.counts, self.schedule_name = chunk_ids, counts, schedule_name
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.z_loss = z_loss
        self.skip_sync = skip_sync  # ids of parameters data parallel leaves alone (expert weights)
        self.scale = 1.0
        self.sequence_shards = 1  # tp under sequence parallel: stages exchange 1/tp of the sequence
        self.fsdp = False  # set by fsdp.apply_fsdp when the stage modules are FSDP2 roots (ZeRO-2/3)
        self.bucket_elems = 1 << 22  # the zero=0 gradient all-reduce's buckets (parallel.bucket_mb of fp32)
        self.grad_sync: GradAllReduce | None = None  # built at the first step (zero=0 with data parallel)
        self.sums: list[torch.Tensor] = []
        self.trace: PipelineTrace | None = None

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from ..loss import cross_entropy_sum

        part = cross_entropy_sum(logits, targets, z_loss=self.z_loss)
        self.sums.append(torch.stack([part.ce_sum.detach(), part.z_sum.detach()]))
        return part.total * self.scale

    def instrument(self, trace: PipelineTrace) -> None:
        self.trace = trace
        for s in self.stages:
            _instrument(s, trace, len(self.stages))


def apply_pipeline(model: Transformer, dims: ParallelDims, parallel: ParallelConfig, train: TrainConfig,
                   data_group, n_microbatches: int, device: torch.device | None = None) -> Transformer:
    """Cut `model` to this pp rank's chunks and build the schedule. Returns the local model (the
    parameters this rank owns, full-model names) with `.pipeline` attached. `device`: where the stages
    run (default: the parameters' device; a model still on the meta device must name it)."""
    from torch.distributed.pipelining import PipelineStage

    # tied embeddings, MoE aux-loss balancing and one-chunk schedules with virtual stages are refused
    # before this runs (infra.config.parallel.unsupported_layout, checked by parallelize)
    pp, pp_rank, pp_group = dims.pp, dims.rank("pp"), dims.group("pp")
    v = parallel.pp_virtual_stages
    counts = chunk_layer_counts(model.cfg, parallel, train.seq_len)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    n_chunks = len(counts)
    chunk_ids = chunks_of_rank(pp_rank, pp, v, parallel.pp_schedule)
    device = device if device is not None else next(model.parameters()).device
    parts, stages = [], []
    # Sequence parallel: the hidden states between stages are 1/tp of the sequence (seed: "the residual
    # stream is split along the sequence"); a later stage derives the tokens' positions from the full length.
    shards = dims.tp if parallel.sequence_parallel and dims.tp > 1 else 1
    for c in chunk_ids:
        layer_ids = list(range(starts[c], starts[c] + counts[c]))
        part = stage_module(model, layer_ids, first=c == 0, last=c == n_chunks - 1)
        if c > 0 and shards > 1:
            part.sequence_shards = shards
            if parallel.cp == 1:  # context parallel's zigzag hook does it otherwise (context_parallel.py)
                part.register_forward_pre_hook(_sequence_positions_hook(shards), with_kwargs=True)
        parts.append(part)
        stages.append(PipelineStage(part, c, n_chunks, device, group=pp_group))
    # The local model: only this rank's layers; embedding/head where its chunks hold them.
    keep = {str(i) for c in chunk_ids for i in range(starts[c], starts[c] + counts[c])}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if 0 not in chunk_ids:
        model.embed_tokens = None
    if n_chunks - 1 not in chunk_ids:
        model.norm, model.lm_head = None, None

    pipe = Pipeline(parts, stages, None, pp_group, data_group, chunk_ids, counts, parallel.pp_schedule,
                    z_loss=model.cfg.z_loss, skip_sync=set())
    cls = schedule_class(parallel.pp_schedule)
    multi = parallel.pp_schedule not in ("gpipe", "1f1b")
    pipe.schedule = cls(stages if multi else stages[0], n_microbatches=n_microbatches, loss_fn=pipe.loss_fn,
                        scale_grads=False)
    pipe.sequence_shards = shards
    pipe.bucket_elems = max(1, int(parallel.bucket_mb * 2**20 / 4))
    model.pipeline = pipe
    plan = getattr(model, "grad_norm_plan", None) or GradNormPlan()
    plan.stage_group = pp_group  # clipping needs the norm over every stage's gradients
    model.grad_norm_plan = plan
    return model


def _sequence_positions_hook(shards: int):
    def hook(module, args, kwargs):
        if kwargs.get("positions") is None and (len(args) < 2 or args[1] is None):
            x = args[0] if args else kwargs["tokens"]
            kwargs = {**kwargs, "positions": torch.arange(x.shape[1] * shards, device=x.device)}
        return args, kwargs

    return hook


# ------------------------------------------------------------------------------------ the train step


def pipeline_train_step(model: nn.Module, optimizer, micro_batches, objective, cfg: TrainConfig, step: int,
                        device: torch.device, dp_group=None, before_update=None):
    """One optimizer step through the pipeline: the schedule runs all micro-batches (forward, loss on
    the last stage, backward), then data-parallel gradient averaging, the global clip and the update.
    `dp_group` is the dp x cp group the token count is agreed over (the loop's argument)."""
    import statistics

    from ..loop import StepResult
    from ..precision import autocast_for
    from ..loss import moe_layers
    from ..model.moe import imbalance
    from ..optim import lr_at, set_lr

    pipe: Pipeline = model.pipeline
    model.train()
    data_group = pipe.data_group
    data_size = dist.get_world_size(data_group) if data_group is not None else 1
    tokens = torch.tensor(float(sum(objective.weight(mb) for mb in micro_batches)), device=device)
    if data_group is not None:
        dist.all_reduce(tokens, group=data_group)
    pipe.scale = data_size / float(tokens.clamp_min(1.0))
    pipe.sums = []
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    shard = getattr(objective, "shard", None)  # context parallel cuts the sequence first
    if shard is not None:
        micro_batches = [shard(mb) for mb in micro_batches]
    inputs = torch.cat([mb.inputs for mb in micro_batches]).to(device)
    targets = torch.cat([mb.targets for mb in micro_batches]).to(device)
    moes = moe_layers(model)
    loads = [torch.zeros(m.num_experts, device=device) for m in moes]
    dropped = torch.zeros(len(moes), device=device)
    if moes:  # the schedule calls forward m times; collect each layer's load after every call
        hooks = [m.register_forward_hook(_load_hook(loads, dropped, j, len(micro_batches))) for j, m in enumerate(moes)]
    trace = pipe.trace
    if trace is not None:
        dist.barrier(group=pipe.pp_group)
        t0 = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    # Data parallel starts on each bucket once the stage's m-th backward has filled it (its cooldown).
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.start_grad_sync_after(len(micro_batches))
    elif data_group is not None and not pipe.fsdp:  # FSDP stages reduce-scatter their own (fsdp.py)
        if pipe.grad_sync is None:
            pipe.grad_sync = GradAllReduce([p for p in params if id(p) not in pipe.skip_sync], data_group,
                                           pipe.bucket_elems)
        pipe.grad_sync.start_after(len(micro_batches))
    args = (inputs,) if pipe.has_first else ()
    with autocast_for(cfg.precision, device):  # bf16 matmuls as in the one-stage step
        pipe.schedule.step(*args, target=targets if pipe.has_last else None)
    if trace is not None:
        trace.window = (t0, time.perf_counter())
    if moes:
        for h in hooks:
            h.remove()
    if isinstance(optimizer, DistributedOptimizer):  # ZeRO-1: reduce-scatter, norm over dp, tp, ep and pp
        grad_norm = optimizer.clip_grad_norm(cfg.grad_clip)
    else:
        if pipe.grad_sync is not None:
            pipe.grad_sync.finish()
        grad_norm = model.grad_norm_plan.clip(params, cfg.grad_clip)
    # The schedule's first step also runs the loss once to infer shapes: keep the micro-batches' own.
    sums = torch.stack(pipe.sums[-len(micro_batches):]).sum(dim=0) if pipe.sums else torch.zeros(2, device=device)
    # The spike guard decides on the global loss: every pp rank must agree on skipping.
    logged = _global_sums(sums, data_group, pipe.pp_group)
    applied = before_update is None or before_update(logged[0], tokens, grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    sums = logged
    moe_stats: dict[str, float] = {}
    if moes:
        if data_group is not None:
            packed = torch.cat(loads)
            dist.all_reduce(packed, group=data_group)
            loads = list(packed.split([m.num_experts for m in moes]))
        for m, load in zip(moes, loads):
            if m.balance == "bias":
                m.update_bias(load)
        moe_stats = {"moe_imbalance": statistics.fmean(imbalance(x) for x in loads),
                     "moe_dropped": float(dropped.mean())}
    total = float(tokens)
    return StepResult(loss=float(sums[0]) / max(total, 1.0), grad_norm=float(grad_norm), lr=lr, tokens=int(total),
                      z_loss=float(sums[1]) / max(total, 1.0), moe=moe_stats, applied=applied)


def _global_sums(sums: torch.Tensor, data_group, pp_group) -> torch.Tensor:
    """The last stage's summed losses over the data group, then shared with every pp rank (the other
    stages contribute zeros, so the pp all-reduce is a broadcast)."""
    sums = sums.clone()
    if data_group is not None:
        dist.all_reduce(sums, group=data_group)
    if pp_group is not None:
        dist.all_reduce(sums, group=pp_group)
    return sums


@torch.no_grad()
def pipeline_evaluate(model: nn.Module, batches, objective, device: torch.device, precision: str = "fp32") -> float:
    """Token-weighted validation cross-entropy: each batch walks the chunks in order, the hidden
    states sent point to point between the ranks holding consecutive chunks (no schedule: evaluation
    is rare and every schedule, zero-bubble ones included, shares this path)."""
    from ..loss import cross_entropy_sum
    from ..precision import autocast_for

    pipe: Pipeline = model.pipeline
    pp_rank = dist.get_rank(pipe.pp_group)
    pp = dist.get_world_size(pipe.pp_group)
    n_chunks = len(pipe.counts)
    virtual = n_chunks // pp
    owner = {c: r for r in range(pp) for c in chunks_of_rank(r, pp, virtual, pipe.schedule_name)}
    local = dict(zip(pipe.chunk_ids, pipe.parts))
    shard = getattr(objective, "shard", None)
    wire = torch.bfloat16 if precision == "bf16" else torch.float32  # hidden states between stages
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, device=device)  # ce, z, tokens
    for mb in batches:
        mb = shard(mb) if shard is not None else mb
        h = None
        for c in range(n_chunks):
            if owner[c] != pp_rank:
                continue
            if c == 0:
                h = mb.inputs.to(device)
            elif owner[c - 1] != pp_rank:
                b, seq = mb.inputs.shape
                h = torch.empty(b, seq // pipe.sequence_shards, model.cfg.dim, device=device, dtype=wire)
                dist.recv(h, dist.get_global_rank(pipe.pp_group, owner[c - 1]), group=pipe.pp_group)
            with autocast_for(precision, device):
                h = local[c](h)
            if c == n_chunks - 1:
                part = cross_entropy_sum(h, mb.targets.to(device), z_loss=pipe.z_loss)
                sums += torch.stack([part.ce_sum.float(), part.z_sum.float(), part.tokens.float()])
            elif owner[c + 1] != pp_rank:
                dist.send(h.to(wire).contiguous(), dist.get_global_rank(pipe.pp_group, owner[c + 1]), group=pipe.pp_group)
    model.train(was_training)
    sums = _global_sums(sums, pipe.data_group, pipe.pp_group)
    return float(sums[0] / sums[2].clamp_min(1.0))


def _load_hook(loads, dropped, j, n_micro):
    def hook(module, args, output):
        loads[j] += module.tokens_per_expert.float()
        dropped[j] += module.dropped_fraction / n_micro
    return hook


def is_pipelined(model: nn.Module) -> bool:
    return getattr(model, "pipeline", None) is not None


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """(p - 1) / (v m + p - 1): GPipe and 1F1B at v = 1, interleaved with v chunks per rank."""
    return (p - 1) / (v * m + p - 1)


def expected_peak_in_flight(schedule: str, p: int, m: int, stage: int) -> int:
    """Micro-batches a stage holds at most: m for GPipe, min(m, p - i) for 1F1B stage i."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - stage)
    raise ValueError(f"no closed form here for {schedule}")


__all__ = ["Pipeline", "PipelineTrace", "apply_pipeline", "pipeline_train_step", "chunk_layer_counts",
           "is_pipelined", "bubble_formula", "expected_peak_in_flight"]
