"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) and sequence parallel (Korthikanti et al. 2022) as
DTensor plans applied from outside the model (`parallelize_module`).

Per block: q/k/v column-wise (each rank holds H/t query heads and K/t KV heads; the model infers
head counts from shapes), o row-wise; gate/up column-wise, down row-wise. Without sequence parallel,
each block's attention and MLP inputs are one replicated DTensor (so q/k/v share one backward
all-reduce) and o/down end in an all-reduce: 2 all-reduces of [b, s, h] per layer forward and 2 in
backward. With sequence parallel the residual stream and the norms are split along the sequence:
each all-reduce becomes a reduce-scatter (o/down) plus an all-gather (before attention/MLP), same
bytes, 1/t of the activation memory (seed: "The all-reduce becomes a reduce-scatter ... and the next
block begins with an all-gather").

Vocab parallel: the embedding is split by vocabulary rows (row-wise: each rank looks up its rows,
zeros elsewhere, then an all-reduce or reduce-scatter) and the LM head by vocabulary columns, its
logits left as a DTensor sharded on the vocabulary for `vocab_parallel.cross_entropy_sum`, so the
full logits never exist on one rank. Every parameter becomes a DTensor on the tp mesh (norm gains
replicated), so gradient-norm clipping and FSDP see one kind of tensor, except MoE layers: they stay
whole (plain tensors, identical on every tp rank) and scale out by expert parallel instead.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from infra.config.model import ModelConfig

from ..model.moe import MoE
from .mesh import ParallelDims


class ReplicateParallel(ParallelStyle):
    """Parameters replicated as DTensors; the plain input taken with `input_layout` (replicated, or
    sharded on the heads for QK-norm), outputs handed back as plain tensors (TorchTitan's NoParallel):
    for the norms when sequence parallel is off."""

    def __init__(self, input_layout=None):
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        layout = self.input_layout

        def to_dtensor(mod, inputs, mesh):
            from torch.distributed.tensor import DTensor

            return tuple(DTensor.from_local(x, mesh, (layout,), run_check=False)
                         if not isinstance(x, DTensor) and hasattr(x, "shape") else x for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local()

        return distribute_module(module, device_mesh, None, input_fn=to_dtensor, output_fn=to_local)


def keep_grads_in_param_layout(model: nn.Module) -> None:
    """Hold every tensor-parallel parameter's gradient in the parameter's own layout as it accumulates.
    The vocab-parallel embedding's weight gradient comes out of DTensor's embedding backward replicated
    (the whole V x D table on every tp rank: no sharding rule gives its rows), where the parameter holds
    Shard(0), the seed's "each GPU stores 16,000 embedding rows"; left so, it stays t x its share until
    zero_grad (and a pipeline stage's data-parallel reduction would send it whole). Replicated to
    sharded is a local slice, no communication; other mismatches (a norm gain's Partial gradient under
    sequence parallel) need a collective and are resolved once per step by the gradient norm.

    Registered after materialisation (trainer.parallel.parallelize): a hook put on a meta-device
    parameter does not survive `to_empty`'s tensor swap; and before the optimizer's and the gradient
    reducers' own post-accumulate hooks, which then see the sharded gradient (hooks run in order)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if (isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tp",)
                and any(pl.is_shard() for pl in p.placements)):
            p.register_post_accumulate_grad_hook(_slice_replicated_grad)


def _slice_replicated_grad(p) -> None:
    g = p.grad
    if g is not None and tuple(g.placements) != tuple(p.placements) and all(pl.is_replicate() for pl in g.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """What this plan supports, refused with the reason (config validation checks divisibility; tied
    embeddings are refused with the other layout rules, infra.config.parallel.unsupported_layout)."""
    if cfg.kv_heads < tp:
        raise ValueError(
            f"tensor parallel tp={tp} with model.n_kv_heads={cfg.kv_heads}: fewer KV heads than tp ranks "
            f"(replicated KV heads) is not implemented; use tp <= n_kv_heads"
        )


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, sequence_parallel: bool) -> nn.Module:
    check_tp(model.cfg, dims.tp)
    mesh = dims.submesh("tp")
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    norm = SequenceParallel() if sp else ReplicateParallel()
    top = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "norm": norm,
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, {k: v for k, v in top.items() if getattr(model, k, None) is not None})
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan(block, residual, sp))
    for module in model.mtp or ():  # multi-token prediction (model/mtp.py): norms, projection, a block
        norm = SequenceParallel() if sp else ReplicateParallel()
        parallelize_module(module, mesh, {
            "hnorm": norm, "enorm": norm, "norm": norm,
            # [h; e] is 2h wide: each rank multiplies its slice of the features (a local cut of the
            # replicated input, or the sequence gathered under SP) and the partial sums are reduced
            # back into the residual layout, as o_proj/down_proj do
            "eh_proj": RowwiseParallel(input_layouts=residual, output_layouts=residual),
        })
        parallelize_module(module.block, mesh, block_plan(module.block, residual, sp))
    return model


def block_plan(block: nn.Module, residual, sp: bool) -> dict:
    """The plan of one transformer block (see the module docstring)."""
    plan = {
        "input_layernorm": SequenceParallel() if sp else ReplicateParallel(),
        "self_attn": PrepareModuleInput(input_layouts=(residual, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
        "post_attention_layernorm": SequenceParallel() if sp else ReplicateParallel(),
        "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual),
    }
    if isinstance(block.mlp, MoE):
        # MoE layers are not split over tp: every tp rank runs the whole layer (its experts spread over
        # ep ranks of the same tp coordinate) on the whole (gathered) sequence, so router, experts,
        # loads and balancing are identical across tp; under SP the output is cut back to this rank's
        # share of the sequence (a slice; its backward gathers the gradient).
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            del plan[name]
        plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(residual,), use_local_output=True)
    if block.self_attn.q_norm is not None:  # per-head norms see local heads: replicated gains
        plan["self_attn.q_norm"] = ReplicateParallel(Shard(2))  # q/k are [B, S, local heads, d]
        plan["self_attn.k_norm"] = ReplicateParallel(Shard(2))
    return plan
