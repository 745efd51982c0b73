"""`pretrain:` (and the base of every training section): batch, optimizer, schedule, precision, checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section
from .faults import FaultsConfig


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="save every N optimizer steps; 0 = only at the end")
    keep_last: int = Field(2, ge=1, description="keep the last K committed checkpoints")
    keep_every: int = Field(0, ge=0, description="also keep every M-th step forever (0 = none)")
    async_save: bool = Field(True, description="stage to CPU memory, write and upload in the background")


class SpikeConfig(Section):
    """Loss-spike detection and response (seed: 'Loss spikes')."""

    enabled: bool = True
    window: int = Field(20, ge=2, description="rolling window of recent losses / grad norms")
    z_threshold: float = Field(6.0, gt=0, description="a step is a spike when (x - mean) / std exceeds this")
    min_history: int = Field(10, ge=1, description="steps observed before spikes can be declared")
    max_skips: int = Field(3, ge=0, description="consecutive skipped steps before rolling back")
    max_rollbacks: int = Field(3, ge=0, description="rollbacks before the job ends `diverged`")
    lr_factor_on_rollback: float = Field(1.0, gt=0, le=1, description="multiply the LR by this after a rollback")
    task_rollbacks: int = Field(
        2, ge=0, description="after a job ends `diverged`: times the task rolls back to an earlier checkpoint and retries"
    )
    task_lr_factor: float = Field(0.5, gt=0, le=1, description="LR scale applied at each task-level rollback")


class Fp8Config(Section):
    """`precision: fp8`: the model's linear layers multiply in float8 e4m3 through torchao's float8
    training (trainer/precision.py: convert_to_fp8), as TorchTitan's float8 converter applies it; weights,
    masters and everything else stay as under bf16."""

    recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="torchao's scaling: one scale per tensor (fastest) or per row (more precise)")
    skip: list[str] = Field(
        default_factory=lambda: ["lm_head", "mlp.gate"],
        description="linear layers kept in bf16, by name or name suffix (a layer whose dimensions are not "
                    "multiples of 16 is always kept): the LM head (its fused loss multiplies the weight itself) "
                    "and the MoE router, as TorchTitan leaves out its output layer and router")
    emulate: bool = Field(False, description="tests only: emulated float8 matmuls on any device (no speed-up); "
                          "not with compile")

    @model_validator(mode="after")
    def _names(self) -> "Fp8Config":
        bad = [n for n in self.skip if not isinstance(n, str) or not n.strip() or n != n.strip(".")]
        if bad:
            raise ValueError(f"fp8.skip: {bad} are not layer names (e.g. lm_head, mlp.gate)")
        return self


class TrainConfig(Section):
    steps: int = Field(1000, ge=1, description="optimizer steps")
    seq_len: int = Field(2048, ge=1, description="tokens per row; rows hold seq_len + 1 tokens")
    micro_batch_size: int = Field(2, ge=1, description="sequences per micro-batch per data-parallel rank")
    global_batch_size: int = Field(16, ge=1, description="sequences per optimizer step over all replicas")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="decay floor as a fraction of the peak")
    warmup_steps: int = Field(100, ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of steps spent decaying at the end")
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="global-norm clip; 0 disables")
    precision: Literal["fp32", "bf16", "fp8"] = Field(
        "bf16", description="fp8: bf16 with the linear layers' matmuls in float8 (pretrain.fp8; needs CUDA >= 8.9)")
    fp8: Fp8Config = Field(default_factory=Fp8Config)
    fp32_grad_accum: bool = Field(False, description="bf16: accumulate and reduce gradients in an fp32 buffer (Megatron's "
                                  "grad_reduce_in_fp32: 18 bytes/param); false: bf16 gradients on the wire (16)")
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    compile: bool = False
    log_every: int = Field(1, ge=1)
    activation_stats: bool = Field(True, description="per-layer RMS and absmax of the residual stream at every "
                                   "logged step (act_rms/layer_NN, act_absmax/layer_NN; trainer/activation_stats.py)")
    straggler_detection: bool = Field(False, description="each rank times its forward-to-backward compute; at logged "
                                      "steps rank 0 logs straggler/slowest_rank, compute_s_max, compute_s_median, "
                                      "ratio (trainer/stragglers.py); off on one process. Off by default: ~1.5% of "
                                      "a tiny CPU step (+ a 0.3 ms all-reduce per logged step), ~0 on a real one")
    mtp_loss_weight: float = Field(0.3, ge=0, description="pretrain with model.mtp_depth D > 0: the loss adds "
                                   "weight / D x the sum of the D MTP depths' cross-entropies (DeepSeek-V3's lambda: "
                                   "0.3, then 0.1 for its last 4.8T tokens)")
    eval_every: int = Field(0, ge=0, description="validation loss every N steps (0 = only at the end)")
    eval_batches: int = Field(4, ge=1)
    peak_flops: float | None = Field(None, gt=0, description="peak FLOP/s per device for MFU; None = measured")
    seed: int | None = Field(None, description="default: the lifecycle seed")
    data_mixture: dict[str, float] | None = Field(
        None,
        description="pretrain only: share of training rows per data source, re-weighting the packed mix at load time "
        "(set from the ablations' choice.json); None: rows uniformly, i.e. the mix data.sources[].weight packed",
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    spike: SpikeConfig = Field(default_factory=SpikeConfig)
    max_restarts: int = Field(0, ge=0, description="torchrun restarts of a failed job, each from the latest checkpoint")
    faults: FaultsConfig = Field(default_factory=FaultsConfig, description="fault injection (tests, drills); off")

    @model_validator(mode="after")
    def _schedule(self) -> "TrainConfig":
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds steps={self.steps}")
        if self.data_mixture is not None:
            if type(self) is not TrainConfig:
                raise ValueError("data_mixture: only pretrain samples packed tokens by source; post-training ignores it")
            check_weights("pretrain.data_mixture", self.data_mixture)
        if self.precision == "fp8" and self.fp8.emulate and self.compile:
            raise ValueError("fp8.emulate runs eagerly only (torchao's emulation is not for torch.compile, as "
                             "TorchTitan documents): set compile=false or fp8.emulate=false")
        return self


def check_weights(field: str, weights: dict[str, float]) -> None:
    """A mixture's weights: none negative (or NaN), not all zero."""
    bad = {k: v for k, v in weights.items() if not v >= 0}
    if bad:
        raise ValueError(f"{field}: weights must be >= 0, got {bad}")
    if not any(v > 0 for v in weights.values()):
        raise ValueError(f"{field}={weights}: every weight is 0 (give at least one source a positive weight)")
