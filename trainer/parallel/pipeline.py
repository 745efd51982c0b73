"""Pipeline parallel: the layers are cut into stages, one (or, interleaved, several) per pp rank, and
micro-batches flow through them under a schedule from `torch.distributed.pipelining` (seed: "the
last stage gets fewer layers" because it also holds the LM head and the loss).

Here, the cut and the schedule (`apply_pipeline`, `Pipeline`). A stage is the same Transformer class
holding a subset of the layers (TorchTitan's approach): the first keeps `embed_tokens`, the last
`norm` and `lm_head`, the others take and return hidden states. The rank's local model keeps exactly
the parameters of its chunks under their full-model names, so optimizer and checkpoint code see an
ordinary module. Beside it: pipeline_split.py (which layers each chunk and rank hold),
pipeline_step.py (a step's micro-batches through the schedule), pipeline_evaluate.py (validation
batches), pipeline_trace.py (timing the passes), pipeline_formulas.py (the schedules' closed forms).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from infra.config.parallel import ParallelConfig
from infra.config.train import TrainConfig

from ..model import Transformer
from .grad_all_reduce import GradAllReduce
from .grad_norm import GradNormPlan
from .mesh import ParallelDims
from .pipeline_split import chunk_layer_counts, chunks_of_rank, stage_module
from .pipeline_trace import PipelineTrace, instrument_stage


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
            instrument_stage(s, trace, len(self.stages))

    def global_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """The last stage's summed losses over the data group, then shared with every pp rank (the other
        stages contribute zeros, so the pp all-reduce is a broadcast)."""
        sums = sums.clone()
        if self.data_group is not None:
            dist.all_reduce(sums, group=self.data_group)
        if self.pp_group is not None:
            dist.all_reduce(sums, group=self.pp_group)
        return sums


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


def is_pipelined(model: nn.Module) -> bool:
    return getattr(model, "pipeline", None) is not None


__all__ = ["Pipeline", "apply_pipeline", "is_pipelined", "schedule_class"]
