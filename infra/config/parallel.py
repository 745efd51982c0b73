"""`parallel:` the device mesh and how model, optimizer and data are split over it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section
from .model import ModelConfig


class ParallelConfig(Section):
    """One mesh, outermost to innermost: dp (dp_replicate x dp_shard), pp, cp, tp; ep reuses dp x cp ranks.

    world size = nnodes * nproc_per_node = dp * pp * cp * tp.
    """

    nnodes: int = Field(1, ge=1)
    nproc_per_node: int = Field(1, ge=1)
    dp: int = Field(1, ge=1, description="data-parallel degree")
    zero: Literal[0, 1, 2, 3] = Field(
        0, description="0 = DDP, 1 = distributed optimizer, 2/3 = FSDP2 without/with resharding after forward"
    )
    dp_replicate: int = Field(1, ge=1, description="HSDP: replicas across which FSDP shards are replicated")
    tp: int = Field(1, ge=1)
    sequence_parallel: bool = Field(False, description="split norms/residuals along the sequence inside TP")
    pp: int = Field(1, ge=1)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "interleaved_zb", "dualpipev"] = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1, description="model chunks per pipeline rank (interleaved schedules)")
    pp_split: list[int] | Literal["auto"] = Field(
        "auto", description="layers per pipeline stage, or auto (balance estimated FLOPs, head included)"
    )
    cp: int = Field(1, ge=1, description="context-parallel degree")
    cp_impl: Literal["ring", "ulysses"] = "ring"
    ep: int = Field(1, ge=1, description="expert-parallel degree (reuses data-parallel x cp ranks)")
    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size for DDP / ZeRO-1 collectives")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl on CUDA, gloo on CPU")
    collective_timeout_s: float | None = Field(
        None, gt=0, description="collective timeout; default 600 s on GPU, 60 s on CPU"
    )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate if self.zero >= 2 else 1

    @model_validator(mode="after")
    def _mesh(self) -> "ParallelConfig":
        product = self.dp * self.pp * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = {product} must equal the world size "
                f"nnodes*nproc_per_node = {self.nnodes}*{self.nproc_per_node} = {self.world_size}"
            )
        if self.dp_replicate > 1 and self.zero < 2:
            raise ValueError(f"dp_replicate={self.dp_replicate} (HSDP) needs zero 2 or 3, got zero={self.zero}")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp={self.dp} is not divisible by dp_replicate={self.dp_replicate}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp} (experts reuse data ranks)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if isinstance(self.pp_split, list):
            if len(self.pp_split) != self.pp * self.pp_virtual_stages:
                raise ValueError(
                    f"pp_split has {len(self.pp_split)} entries; expected pp*pp_virtual_stages = "
                    f"{self.pp * self.pp_virtual_stages}"
                )
            if any(n < 0 for n in self.pp_split):
                raise ValueError(f"pp_split={self.pp_split} has a negative layer count")
        if self.pp_schedule in ("interleaved_1f1b", "interleaved_zb") and self.pp_virtual_stages < 2:
            raise ValueError(f"pp_schedule={self.pp_schedule} needs pp_virtual_stages >= 2")
        if self.pp_schedule in ("zbv", "dualpipev") and self.pp_virtual_stages != 2:
            raise ValueError(f"pp_schedule={self.pp_schedule} needs pp_virtual_stages = 2 (V-shape)")
        unsupported = unsupported_layout(self)
        if unsupported:
            raise ValueError(unsupported)
        return self


def unsupported_layout(p: ParallelConfig, model: ModelConfig | None = None) -> str | None:
    """Why the trainer cannot compose this mesh (sizes are valid, the combination is not built), or None;
    with `model`, also what this model cannot do on it. The one list of these rules: config validation
    calls it, and the trainer again at start (trainer.parallel.layouts.check_supported)."""
    if p.pp > 1 and p.pp_schedule in ("gpipe", "1f1b") and p.pp_virtual_stages != 1:
        return (f"parallel.pp_schedule={p.pp_schedule} runs one model chunk per rank, pp_virtual_stages="
                f"{p.pp_virtual_stages}; use interleaved_1f1b or interleaved_zb for several")
    if model is not None:
        if model.tie_embeddings and (p.pp > 1 or p.tp > 1):
            return (f"model.tie_embeddings with parallel.pp={p.pp} tp={p.tp}: the embedding and the LM head sit on "
                    "different pipeline stages, or are split along different dimensions by tensor parallel; untie them")
        if p.cp > 1 and p.cp_impl == "ulysses" and (model.kv_heads // p.tp) % p.cp:
            # Refused rather than duplicating KV heads: a copy per cp rank would multiply Ulysses's K/V
            # all-to-all bytes and attention memory by cp / (KV heads per tp rank), which is what the
            # ring avoids; the seed: "its degree is capped by the number of KV heads".
            return (f"parallel.cp_impl=ulysses with parallel.cp={p.cp} tp={p.tp}: Ulysses splits the KV heads over "
                    f"the cp ranks, and model.n_kv_heads={model.kv_heads} ({model.kv_heads // p.tp} per tp rank) is "
                    f"not divisible by cp={p.cp}; its degree is capped by the KV heads: use cp_impl=ring, or a cp "
                    f"that divides the KV heads per tp rank")
        if model.mtp_depth and (p.pp > 1 or p.cp > 1):
            return (f"model.mtp_depth={model.mtp_depth} with parallel.pp={p.pp} cp={p.cp}: the MTP modules read the "
                    "embeddings of later tokens, which a pipeline's last stage and a context-parallel sequence shard "
                    "do not hold; set model.mtp_depth=0 or pp=cp=1")
        if model.moe is not None and model.moe.balance == "aux_loss" and p.pp > 1:
            return (f"model.moe.balance=aux_loss with parallel.pp={p.pp}: the auxiliary loss of earlier stages has no "
                    "path to the pipeline schedule's loss; use model.moe.balance=bias (DeepSeek-V3's bias balancing)")
    if p.zero >= 2 and (p.cp > 1 or p.ep > 1):
        return (f"parallel.zero={p.zero} (FSDP) with parallel.cp={p.cp} ep={p.ep}: FSDP composes with tensor and "
                f"pipeline parallel only; use zero=1 (distributed optimizer) or zero=0 with context or expert parallel")
    if p.tp > 1 and p.zero == 0 and p.pp == 1 and p.dp * p.cp > 1:
        # The pipeline step averages gradients itself (DTensors included); without it, DDP would, and DDP
        # does not take tensor-parallel DTensors.
        return (f"parallel.tp={p.tp} with parallel.dp={p.dp} cp={p.cp} and zero=0: DDP does not take "
                f"tensor-parallel DTensors; set parallel.zero to 1, 2 or 3")
    return None
