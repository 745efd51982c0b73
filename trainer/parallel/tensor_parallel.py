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

from ..lora import lora_modules
from ..model.moe import MoE
from .mesh import ParallelDims
from .model_parts import modules_outside_transformers, transformers_of


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
    reducers' own post-accumulate hooks, which then see the sharded gradient (hooks run in order). Frozen
    parameters (a reward model's unused LM head, LoRA's base weights) have no gradient and no hook."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if (p.requires_grad and isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tp",)
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
    """The plan below on every Transformer `model` is or holds (model_parts.py); any other module with
    parameters (a reward or value head on the trunk's hidden states) replicated over tp as DTensors, so its
    gradient is the same on every tp rank and clipping sees one kind of tensor."""
    mesh = dims.submesh("tp")
    trunks = transformers_of(model)
    if not trunks:
        raise ValueError(f"tensor parallel: {type(model).__name__} holds no Transformer to split")
    for trunk in trunks:
        _plan_transformer(trunk, mesh, sequence_parallel)
    for name, module in modules_outside_transformers(model).items():
        if next(module.children(), None) is not None:
            raise NotImplementedError(
                f"tensor parallel: {name or type(module).__name__} ({type(module).__name__}) holds parameters of its "
                "own and submodules; only leaf modules outside the Transformers (heads) are replicated over tp")
        parallelize_module(module, mesh, ReplicateParallel())
    return model


def _plan_transformer(model: nn.Module, mesh, sequence_parallel: bool) -> None:
    check_tp(model.cfg, mesh.size())
    if lora_modules(model):
        raise NotImplementedError(f"tensor parallel tp={mesh.size()} with LoRA adapters: the plan splits nn.Linear "
                                  "layers and a LoRA layer is not one; use data parallel (DDP, zero=1/2/3) with LoRA")
    sp = sequence_parallel
    if sp:
        model.register_forward_pre_hook(_sequence_splits(mesh.size()), with_kwargs=True)
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


def _sequence_splits(tp: int):
    """A forward pre-hook refusing token batches whose length does not split over the tp ranks (pretraining's
    seq_len is validated; post-training's batches are as long as their longest row)."""
    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("tokens")
        if tokens is not None and not tokens.is_floating_point() and tokens.shape[1] % tp:
            raise ValueError(f"sequence parallel splits each sequence over tp={tp} ranks, and this batch's rows "
                             f"hold {tokens.shape[1]} tokens; pad them to a multiple of {tp} or set "
                             "parallel.sequence_parallel=false")

    return hook


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
