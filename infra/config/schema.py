"""The root config: one YAML file per lifecycle, one section per stage plus model, parallel, infra."""

from __future__ import annotations

from pydantic import Field, model_validator

from .ablations import AblationsConfig, check_mixture_sources
from .base import Section
from .data import DataConfig, TokenizerConfig
from .estimate import EstimateConfig
from .evaluate import EvaluateConfig
from .export import ExportConfig
from .infra import InfraConfig
from .model import ModelConfig
from .parallel import ParallelConfig, unsupported_layout
from .posttrain import PosttrainConfig
from .serve import ServeConfig
from .train import TrainConfig

STAGES = ("data", "tokenizer", "ablations", "pretrain", "posttrain", "export", "evaluate", "serve")


class LifecycleConfig(Section):
    name: str = Field("eightfold", min_length=1, description="MLflow experiment and artifact namespace")
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    ablations: AblationsConfig = Field(default_factory=AblationsConfig)
    pretrain: TrainConfig = Field(default_factory=TrainConfig)
    infra: InfraConfig = Field(default_factory=InfraConfig)
    estimate: EstimateConfig = Field(default_factory=EstimateConfig)
    posttrain: PosttrainConfig = Field(default_factory=PosttrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _cross_section(self) -> "LifecycleConfig":
        m, p, t = self.model, self.parallel, self.pretrain
        if m.n_heads % p.tp:
            raise ValueError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}")
        if m.kv_heads % p.tp:
            raise ValueError(
                f"model.n_kv_heads={m.kv_heads} is not divisible by parallel.tp={p.tp}: each tensor-parallel "
                "rank needs whole KV heads (replicating KV heads across tp ranks is not built)"
            )
        if m.vocab_size % p.tp:
            raise ValueError(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={p.tp} (vocab-parallel)")
        if self.tokenizer.vocab_size != m.vocab_size:
            raise ValueError(
                f"tokenizer.vocab_size={self.tokenizer.vocab_size} must equal model.vocab_size={m.vocab_size}"
            )
        if t.seq_len > m.max_seq_len:
            raise ValueError(f"pretrain.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        per_step = t.micro_batch_size * p.dp
        if t.global_batch_size % per_step:
            raise ValueError(
                f"pretrain.global_batch_size={t.global_batch_size} is not divisible by "
                f"micro_batch_size*dp = {t.micro_batch_size}*{p.dp} = {per_step}"
            )
        micro_batches = t.global_batch_size // per_step
        if p.pp > 1 and micro_batches < p.pp:
            raise ValueError(
                f"pipeline needs at least pp={p.pp} micro-batches per step, got {micro_batches} "
                f"(global_batch_size / (micro_batch_size * dp))"
            )
        if p.pp * p.pp_virtual_stages > m.n_layers:
            raise ValueError(
                f"parallel.pp*pp_virtual_stages={p.pp * p.pp_virtual_stages} exceeds model.n_layers={m.n_layers}"
            )
        if isinstance(p.pp_split, list) and sum(p.pp_split) != m.n_layers:
            raise ValueError(f"parallel.pp_split={p.pp_split} sums to {sum(p.pp_split)}, model.n_layers={m.n_layers}")
        if p.cp > 1 and t.seq_len % (2 * p.cp):
            raise ValueError(f"pretrain.seq_len={t.seq_len} must be divisible by 2*cp={2 * p.cp} (zigzag split)")
        if t.precision == "fp8" and p.tp > 1:  # Float8Linear needs torchao's float8 TP plans, which we do not apply
            raise ValueError(f"pretrain.precision=fp8 with parallel.tp={p.tp}: float8 training runs with dp, zero, "
                             "fsdp, pp, cp and ep, not tensor parallel; set tp=1 or precision=bf16")
        if t.precision in ("bf16", "fp8") and t.fp32_grad_accum and not (
                (p.zero == 1 and p.dp * p.cp > 1) or (p.zero >= 2 and p.dp_shard > 1)):
            # Megatron's fp32 gradient buffer lives in its distributed optimizer; ours in ZeRO-1's and FSDP's.
            raise ValueError(
                f"pretrain.fp32_grad_accum with precision {t.precision} and parallel.zero={p.zero} dp={p.dp} cp={p.cp}: the "
                "fp32 gradient buffer is kept by the distributed optimizer (zero=1 over dp x cp > 1) or FSDP (zero "
                "2/3, which then reduces in fp32); set one, or fp32_grad_accum=false (bf16 gradients, fp32 masters)")
        unsupported = unsupported_layout(p, m)  # the rules that need the model too (the rest: ParallelConfig)
        if unsupported:
            raise ValueError(unsupported)
        check_mixture_sources(self.ablations, [s.name for s in self.data.sources], t.data_mixture)
        if p.ep > 1:
            if m.moe is None:
                raise ValueError(f"parallel.ep={p.ep} needs model.moe")
            if m.moe.num_experts % p.ep:
                raise ValueError(f"model.moe.num_experts={m.moe.num_experts} is not divisible by parallel.ep={p.ep}")
        if self.serve.variant != "hf" and self.serve.variant not in self.export.variants:
            raise ValueError(f"serve.variant={self.serve.variant} is not exported: export.variants = "
                             f"{self.export.variants}")
        return self

    @property
    def grad_accum_steps(self) -> int:
        return self.pretrain.global_batch_size // (self.pretrain.micro_batch_size * self.parallel.dp)
