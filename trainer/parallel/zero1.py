"""ZeRO-1, the distributed optimizer (Megatron's): optimizer state sharded over the data-parallel group.

Seed: "Gradients are reduce-scattered, each GPU runs AdamW on its 1/d, then the updated bf16 weights
are all-gathered. The traffic equals one all-reduce, so this is free memory."

Layout. The parameters (this rank's local tensors: under tensor parallel, its TP shard) are laid
end to end and cut into buckets of about `bucket_mb` of fp32. Each bucket is padded to a multiple of
d and rank r owns elements [r*n/d, (r+1)*n/d) of it. The owned range cuts parameters into segments;
each segment gets a fp32 master (a view into the parameter itself when the parameter is fp32, as the
trainer's are: the parameters ARE the fp32 masters and bf16 is autocast's) and its own AdamW or SGD
moments, in a torch optimizer over the segments with the same decay / no-decay groups as
`trainer.optim`. So per rank the moments are 1/d of DDP's.

Step. Micro-batches accumulate gradients locally (no communication); then per bucket: copy the
gradients into a flat buffer, reduce-scatter it, divide by d (the mean, as DDP), measure the global
gradient norm (squares summed over this rank's segments, all-reduced over dp, and over tp for
tensor-parallel-sharded parameters), clip, step, and all-gather the updated owned ranges back into
every rank's parameters.

Overlap (Megatron's overlap_grad_reduce and overlap_param_gather). The loop calls
`start_grad_sync_after(1)` before the last micro-batch's backward (the pipeline step
`start_grad_sync_after(m)` before its schedule): from then on post-accumulate-grad hooks count each
bucket's ready parameters (grad_ready.py) and a bucket's reduce-scatter starts as soon as its last
gradient is in, while backward computes the earlier layers; `clip_grad_norm` launches whatever no hook
did and waits. `step()` launches every bucket's all-gather and returns; the next forward waits for a
bucket in a pre-hook of the first unit that uses it (param_ready.py). Same buckets, same buffers, same
collectives as without overlap, only issued earlier: the results are bit-identical.

Composition. The "data" group is every rank holding the same weights and seeing different tokens:
dp, or dp x cp under context parallel (Megatron's distributed optimizer also shards over dp x cp).
Under pipeline parallel a rank's model is its stages only, so the buckets hold those, and the norm's
squares are also summed over pp. Expert-parallel experts are not replicated over the data group
(trainer.parallel.expert_parallel syncs them as they are produced): they stay whole on their rank,
with their own moments, and their squares are summed over the ep group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from infra.config.train import TrainConfig

from .grad_ready import GradReadiness
from .mesh import ParallelDims, data_context_group
from .param_ready import register_param_waits


def fqn_of(model: nn.Module, name: str) -> str:
    """A parameter's fully-qualified name as `get_model_state_dict` spells it (no activation-checkpoint
    or compile wrapper prefixes): the key its weights and moments share in a checkpoint."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    (fqn,) = _get_fqns(model, name)
    return fqn


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def tp_sharded(p: torch.Tensor) -> bool:
    """True when a DTensor parameter is split (not replicated) across its mesh: its local squares are
    one part of the global sum."""
    placements = getattr(p, "placements", None)
    return bool(placements) and any(pl.is_shard() for pl in placements)


@dataclass
class Segment:
    param: nn.Parameter
    name: str
    start: int  # offset in the flattened local parameter
    length: int
    shard_offset: int  # offset in this rank's shard of the bucket
    master: torch.Tensor  # fp32, the optimizer's "parameter"

    @property
    def own_master(self) -> bool:
        """The master is a copy (a non-fp32 parameter), not a view of the parameter itself."""
        return self.param.dtype != torch.float32


@dataclass
class Bucket:
    params: list[tuple[str, nn.Parameter, int]]  # (name, param, offset in bucket)
    numel: int
    padded: int
    shard: int
    segments: list[Segment]


class DistributedOptimizer:
    """Looks like a torch optimizer to the loop (`param_groups`, `zero_grad`, `state_dict`) and adds
    `clip_grad_norm(max_norm) -> grad norm`, which the loop calls instead of `trainer.optim`'s
    (the gradients must be reduce-scattered before their norm is known)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, dims: ParallelDims, bucket_mb: float, group=None,
                 overlap_grad_reduce: bool = True, overlap_param_gather: bool = True):
        self.group = group if group is not None else data_context_group(dims)  # dp (x cp)
        if self.group is None:
            raise ValueError("ZeRO-1 needs a data-parallel (x cp) group of more than one rank")
        self.tp_group = dims.group("tp")
        self.d = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        plan = getattr(model, "grad_norm_plan", None)  # set by expert and pipeline parallel
        local_ids = plan.sharded if plan is not None else set()
        self.expert_group = plan.shard_group if plan is not None else None
        self.stage_group = plan.stage_group if plan is not None else dims.group("pp")
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("ZeRO-1: the model has no trainable parameters")
        self.fqns = {n: fqn_of(model, n) for n, _ in trainable}
        self.own_masters = any(p.dtype != torch.float32 for _, p in trainable)  # masters are copies
        self._table = None  # zero1_state.ShardTable, built at the first state_dict()
        self._boxes: dict[int, list] = {}
        named = [(n, p) for n, p in trainable if id(p) not in local_ids]
        # Expert weights: whole, on this rank only (their gradient is already summed where needed).
        self.experts = [Segment(param=p, name=n, start=0, length=p.numel(), shard_offset=-1,
                                master=p.detach().view(-1) if p.dtype == torch.float32 else p.detach().float().view(-1))
                        for n, p in trainable if id(p) in local_ids]
        cap = max(1, int(bucket_mb * 2**20 / 4))
        self.buckets: list[Bucket] = []
        current: list[tuple[str, nn.Parameter, int]] = []
        size = 0
        for name, p in named:
            current.append((name, p, size))
            size += local(p).numel()
            if size >= cap:
                self.buckets.append(self._bucket(current, size))
                current, size = [], 0
        if current:
            self.buckets.append(self._bucket(current, size))
        self._shards: list[torch.Tensor] | None = None
        # The wire (Megatron's grad_reduce_in_fp32): gradients reduce-scatter in the parameters' dtype (bf16:
        # the seed's 2 bytes), or accumulate and reduce in an fp32 buffer with fp32_grad_accum (18 bytes).
        self.fp32_grads = cfg.fp32_grad_accum and any(p.dtype != torch.float32 for _, p in named)
        if self.fp32_grads:
            for _, p in named:
                p.register_post_accumulate_grad_hook(accumulate_in_fp32)
            pipe = getattr(model, "pipeline", None)
            for stage in pipe.stages if pipe is not None else []:
                fold_weight_pass_into_fp32(stage, {id(p) for _, p in named})
        # In flight: bucket index -> (work, reduce-scatter output) and -> (work, gathered buffer, shard sent).
        self._grad_sync: dict[int, tuple] = {}
        self._param_sync: dict[int, tuple] = {}
        bucket_params = [[p for _, p, _ in b.params] for b in self.buckets]
        # After accumulate_in_fp32 (hooks run in registration order): main_grad is whole when a bucket launches.
        self.readiness = GradReadiness(bucket_params, self.start_grad_sync) if overlap_grad_reduce else None
        self.overlap_param_gather = overlap_param_gather
        if overlap_param_gather:
            register_param_waits(model, bucket_params, self.finish_param_sync, self.finish_param_sync)
        segments = [s for b in self.buckets for s in b.segments] + self.experts
        decay = [s.master for s in segments if s.param.dim() >= 2]
        no_decay = [s.master for s in segments if s.param.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # A rank may own no segment of one group (tiny models): torch optimizers accept empty groups.
        if cfg.optimizer == "sgd":
            self.inner: torch.optim.Optimizer = torch.optim.SGD(groups, lr=cfg.lr)
        else:
            self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           foreach=True)

    def _bucket(self, params: list[tuple[str, nn.Parameter, int]], numel: int) -> Bucket:
        padded = math.ceil(numel / self.d) * self.d
        shard = padded // self.d
        lo, hi = self.rank * shard, (self.rank + 1) * shard
        segments = []
        for name, p, offset in params:
            n = local(p).numel()
            a, b = max(lo, offset), min(hi, offset + n)
            if a >= b:
                continue
            flat = local(p).detach().view(-1)[a - offset:b - offset]
            master = flat if flat.dtype == torch.float32 else flat.float().clone()
            segments.append(Segment(param=p, name=name, start=a - offset, length=b - a, shard_offset=a - lo,
                                    master=master))
        return Bucket(params=params, numel=numel, padded=padded, shard=shard, segments=segments)

    # --- what the loop sees -------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def start_grad_sync_after(self, backwards: int = 1) -> None:
        """The next `backwards` backward passes finish this step's gradients (the loop's last micro-batch: 1;
        a pipeline stage: its m micro-batches): reduce-scatter each bucket as soon as they have."""
        if self.readiness is not None:
            self.readiness.arm(backwards)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._grad_sync:  # launched by hooks but never used (no clip, no step): finish, as every rank does
            self._finish_grad_sync()
        if self.readiness is not None:
            self.readiness.reset()
        for b in self.buckets:
            for _, p, _ in b.params:
                p.grad = None
                p.main_grad = None
            for s in b.segments:
                s.master.grad = None
        for s in self.experts:
            s.param.grad = None
            s.master.grad = None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Reduce-scatter the accumulated gradients, measure their global norm and clip (0: measure
        only). The loop calls this in place of `trainer.optim.clip_grad_norm`, then `step()`."""
        self._shards = self._reduce_scatter_grads()
        norm = self._global_norm()
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
            for s in self._all_segments():
                if s.master.grad is not None:
                    s.master.grad.mul_(coef)
        return norm

    def step(self) -> None:
        """AdamW/SGD on the owned segments, then all-gather the updated parameters."""
        if self._shards is None:  # called without clip_grad_norm: reduce now, no clipping
            self._shards = self._reduce_scatter_grads()
        self.inner.step()
        self._all_gather_params(self._shards)
        self._shards = None
        with torch.no_grad():
            for s in self.experts:  # a copy only when the parameter is not fp32 (the master is a view otherwise)
                if s.master.data_ptr() != s.param.data_ptr():
                    s.param.view(-1).copy_(s.master)

    # --- the collectives ----------------------------------------------------------------------------
    def _segments(self):
        return (s for b in self.buckets for s in b.segments)

    def _all_segments(self):
        yield from self._segments()
        yield from self.experts

    def start_grad_sync(self, i: int) -> None:
        """Copy bucket i's accumulated gradients into a flat buffer and launch its reduce-scatter."""
        b = self.buckets[i]
        ref = local(b.params[0][1])
        dtype = torch.float32 if self.fp32_grads else ref.dtype
        flat = torch.zeros(b.padded, dtype=dtype, device=ref.device)
        for _, p, offset in b.params:
            g = getattr(p, "main_grad", None) if self.fp32_grads else p.grad
            if g is not None:
                if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
                    # e.g. the row-split embedding's gradient comes back in another layout
                    g = g.redistribute(p.device_mesh, p.placements)
                g = local(g)
                flat[offset:offset + g.numel()].copy_(g.reshape(-1))
        out = torch.empty(b.shard, dtype=dtype, device=ref.device)
        self._grad_sync[i] = (dist.reduce_scatter_tensor(out, flat, group=self.group, async_op=True), out)

    def _finish_grad_sync(self) -> list[torch.Tensor]:
        """Launch the buckets no hook launched (every one without overlap, in bucket order), then wait for
        all; returns their reduce-scattered shards in bucket order."""
        for i in range(len(self.buckets)):
            if i not in self._grad_sync:
                self.start_grad_sync(i)
        shards = []
        for i in range(len(self.buckets)):
            work, out = self._grad_sync.pop(i)
            work.wait()
            shards.append(out)
        if self.readiness is not None:
            self.readiness.reset()
        return shards

    def _reduce_scatter_grads(self) -> list[torch.Tensor]:
        self.finish_param_sync()  # normally done by the forward's hooks already
        shards = self._finish_grad_sync()
        for b, out in zip(self.buckets, shards):
            out.div_(self.d)  # the mean over replicas, as DDP (the loop's loss scale expects it)
            for s in b.segments:
                g = out[s.shard_offset:s.shard_offset + s.length]
                s.master.grad = g if g.dtype == s.master.dtype else g.to(s.master.dtype)
        for s in self.experts:
            g = s.param.grad
            s.master.grad = None if g is None else g.detach().reshape(-1).to(s.master.dtype)
        return shards

    def _global_norm(self) -> torch.Tensor:
        """sqrt of the sum of squares over every rank's segments; tensor-parallel-sharded parameters
        also sum over tp (replicated ones are identical on every tp rank and count once); experts over
        ep; and every pipeline stage's total over pp."""
        device = next(self._any_param()).device
        sq = torch.zeros(3, dtype=torch.float32, device=device)  # [tp-sharded, replicated, experts]
        for s in self._segments():
            sq[0 if tp_sharded(s.param) else 1] += s.master.grad.float().square().sum()
        for s in self.experts:
            if s.master.grad is not None:
                sq[2] += s.master.grad.float().square().sum()
        dense = sq[:2].clone()
        dist.all_reduce(dense, group=self.group)
        sq[:2] = dense
        if self.tp_group is not None:
            part = sq[:1].clone()
            dist.all_reduce(part, group=self.tp_group)
            sq[0] = part[0]
        if self.expert_group is not None:
            part = sq[2:].clone()
            dist.all_reduce(part, group=self.expert_group)
            sq[2] = part[0]
        total = sq.sum()
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        return total.sqrt()

    def _any_param(self):
        yield from (local(p) for b in self.buckets for _, p, _ in b.params)
        yield from (s.param for s in self.experts)

    @torch.no_grad()
    def _all_gather_params(self, shards: list[torch.Tensor]) -> None:
        """Launch every bucket's all-gather; wait now without overlap_param_gather, else in the next
        forward (finish_param_sync, called per bucket by param_ready's hooks)."""
        self.finish_param_sync()
        for i, (b, shard) in enumerate(zip(self.buckets, shards)):
            dtype = local(b.params[0][1]).dtype  # the updated weights go out in the model's dtype (bf16)
            shard = shard if shard.dtype == dtype else torch.empty(b.shard, dtype=dtype, device=shard.device)
            shard.zero_()
            for s in b.segments:
                shard[s.shard_offset:s.shard_offset + s.length].copy_(s.master)
            full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
            work = dist.all_gather_into_tensor(full, shard, group=self.group, async_op=True)
            self._param_sync[i] = (work, full, shard)  # the shard too: it is read until the gather is done
        if not self.overlap_param_gather:
            self.finish_param_sync()

    @torch.no_grad()
    def finish_param_sync(self, indices: list[int] | None = None) -> None:
        """Wait for the given buckets' all-gathers (default: all in flight) and copy them into the parameters."""
        for i in (sorted(self._param_sync) if indices is None else indices):
            if i not in self._param_sync:
                continue
            work, full, _ = self._param_sync.pop(i)
            work.wait()
            for _, p, offset in self.buckets[i].params:
                t = local(p.data)
                t.view(-1).copy_(full[offset:offset + t.numel()])

    # --- checkpointing ------------------------------------------------------------------------------
    # The state is the one `get_optimizer_state_dict(model, opt, options=StateDictOptions(
    # flatten_optimizer_state_dict=True))` gives a plain torch optimizer: "state.{fqn}.{step, exp_avg,
    # exp_avg_sq}" and "param_groups.{fqn}.{lr, betas, ...}", keyed by the parameter's fully-qualified
    # name, each moment a ShardedTensor of the parameter's global shape of which this rank holds its
    # segment (zero1_state). Plus "state.{fqn}.master", the fp32 master, where it is a copy (a non-fp32
    # parameter); a fp32 parameter is its own master and the model state holds it. So a checkpoint
    # saved by ZeRO-1 on any mesh loads into a plain optimizer, or ZeRO-1 on another mesh, and back.
    fqn_state_dict = True  # trainer.checkpoint: state_dict() is keyed by fqn, DCP-ready

    def state_dict(self, masters: bool = True) -> dict:
        """Views of this rank's state (DCP stages from them and loads into them in place)."""
        from .zero1_state import sharded

        self._init_state()
        table = self._shard_table()
        out: dict = {}
        for s, group in self._segments_with_group():
            st = self.inner.state.get(s.master, {})
            shape, boxes, meta = s.param.shape, self._boxes[id(s)], table.shards(self.fqns[s.name])
            fqn = self.fqns[s.name]
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out[f"state.{fqn}.{k}"] = sharded(v, boxes, shape, meta, table.rank)
                else:
                    out[f"state.{fqn}.{k}"] = v
            if masters and s.own_master:
                out[f"state.{fqn}.master"] = sharded(s.master, boxes, shape, meta, table.rank)
            for k, v in group.items():
                if k != "params":
                    out[f"param_groups.{fqn}.{k}"] = v
        return out

    def master_state_dict(self) -> dict:
        """{fqn: the masters that are copies}, as sharded tensors of the model's shapes: a checkpoint
        without masters (a plain optimizer's) fills them from its model weights at full precision."""
        from .zero1_state import sharded

        table = self._shard_table()
        return {self.fqns[s.name]: sharded(s.master, self._boxes[id(s)], s.param.shape,
                                          table.shards(self.fqns[s.name]), table.rank)
                for s, _ in self._segments_with_group() if s.own_master}

    def load_state_dict(self, state: dict) -> None:
        """Copy a state_dict()-shaped dict (as filled by dcp.load) into this rank's state. Hyper-parameters
        ("param_groups.*") stay the config's; the loop sets the learning rate every step."""
        mine = self.state_dict(masters=any(k.endswith(".master") for k in state))
        with torch.no_grad():
            for key, target in mine.items():
                if key.startswith("param_groups.") or key not in state:
                    continue
                src = state[key]
                if isinstance(target, torch.Tensor) and hasattr(target, "local_shards"):
                    for a, b in zip(target.local_shards(), src.local_shards()):
                        if a.tensor.data_ptr() != b.tensor.data_ptr():
                            a.tensor.copy_(b.tensor)
                elif isinstance(target, torch.Tensor):
                    if target is not src:
                        target.copy_(src)
                else:
                    raise ValueError(f"ZeRO-1 state {key}: cannot load a {type(src).__name__}")
            missing = [k for k in mine if k.startswith("state.") and k not in state]
            if missing:
                raise KeyError(f"ZeRO-1 state is missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")

    def _segments_with_group(self):
        group_of = {id(m): g for g in self.inner.param_groups for m in g["params"]}
        for s in self._all_segments():
            yield s, group_of[id(s.master)]

    @torch.no_grad()
    def _init_state(self) -> None:
        """The state a first step creates (AdamW's step and moments), so a fresh optimizer has tensors
        for dcp.load to fill: a step at lr 0 on zero gradients, which changes no master (DSD's
        _init_optim_state does the same for plain optimizers, but skips tensors without requires_grad,
        as the masters are). The step count goes back to 0: unloaded, the state is a fresh one.
        """
        if self.inner.state:
            return
        masters = [m for g in self.inner.param_groups for m in g["params"]]
        for m in masters:
            m.grad = torch.zeros_like(m)
        lrs = [g["lr"] for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        self.inner.step()
        for g, lr in zip(self.inner.param_groups, lrs):
            g["lr"] = lr
        for m in masters:
            m.grad = None
        for st in self.inner.state.values():  # as a fresh optimizer's first step would find it
            if isinstance(st.get("step"), torch.Tensor):
                st["step"].zero_()

    def _shard_table(self):
        """Which global rectangles each rank's segments are, gathered over the world at the first call
        (every rank checkpoints at the same step); the layout never changes after."""
        from .zero1_state import ShardTable, segment_boxes

        if self._table is None:
            self._boxes = {id(s): segment_boxes(s.param, s.start, s.length) for s in self._all_segments()}
            mine: dict = {}
            for s in self._all_segments():
                mine.setdefault(self.fqns[s.name], []).extend(self._boxes[id(s)])
            self._table = ShardTable(mine, next(self._any_param()).device)
        return self._table

    def state_bytes(self) -> int:
        """Bytes of optimizer state (moments, momentum) this rank holds."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)


def accumulate_in_fp32(p: torch.Tensor) -> None:
    """After each micro-batch's gradient lands in `p.grad` (bf16): add it to the fp32 buffer `p.main_grad`
    and free the bf16 one, so micro-batches sum in fp32 (Megatron's main_grad)."""
    if p.grad is None:
        return
    g = p.grad.to(torch.float32)
    p.main_grad = g if getattr(p, "main_grad", None) is None else p.main_grad.add_(g)
    p.grad = None


def fold_weight_pass_into_fp32(stage, ids: set[int]) -> None:
    """Zero-bubble schedules (ZBV, interleaved zero bubble, DualPipeV) split a stage's backward: the input
    pass, then a weight pass that assigns or adds each weight's gradient to `.grad` itself
    (torch.distributed.pipelining's stage_backward_weight), so autograd's post-accumulate hook, and with it
    `accumulate_in_fp32`, never runs. After every weight pass of `stage`, add what it left in `.grad` to
    the fp32 `main_grad` and free it, as the hook does: each micro-batch's gradient still sums in fp32.
    (A weight pass the schedule runs as a full backward, the first stage's, goes through the hook and
    leaves nothing.) Only parameters in `ids` (the distributed optimizer's) are folded."""
    run = stage.backward_weight_one_chunk

    def backward_weight_one_chunk(*args, **kwargs):
        out = run(*args, **kwargs)
        for p in stage.submod.parameters():
            if p.grad is not None and id(p) in ids:
                accumulate_in_fp32(p)
        return out

    stage.backward_weight_one_chunk = backward_weight_one_chunk


def optimizer_state_bytes(optimizer) -> int:
    """The same measure for a plain torch optimizer (DDP's full copy)."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.state_bytes()
    return sum(local(t).numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)  # a DTensor's (FSDP, TP) local shard


def build_parallel_optimizer(model: nn.Module, dims: ParallelDims, parallel, cfg: TrainConfig):
    """ZeRO-1 over dp (x cp) when `parallel.zero == 1` and that group has more than one rank; otherwise the
    plain optimizer (which, under FSDP, steps on the parameters' shards)."""
    from ..optim import build_optimizer

    if parallel.zero == 1 and dims.dp * dims.cp > 1:
        return DistributedOptimizer(model, cfg, dims, parallel.bucket_mb)
    return build_optimizer(model, cfg)
