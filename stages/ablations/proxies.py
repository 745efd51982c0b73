"""Proxy models and the sweep: shapes scaled from the target `model:`, a token budget per proxy, and
the axes crossed with every shape. Plain data; nothing here trains.

N (parameters) counts what costs FLOPs: every matmul weight, so the embedding lookup is left out and an
untied LM head is kept (the head is most of a small proxy's compute). C = FLOPs per token x D, with the
estimator's formula (trainer/estimate/formulas.py: 6 x matmul params + attention), so proxies and the
target are measured with the same ruler.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from infra.config import LifecycleConfig
from infra.config.ablations import ProxySize
from infra.config.model import ModelConfig
from infra.config.parallel import ParallelConfig
from infra.config.train import TrainConfig
from trainer.estimate.formulas import flops_per_token, param_counts


def matmul_params(model: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (active, less the embedding lookup)."""
    counts = param_counts(model)
    return counts["active"] - (0 if model.tie_embeddings else counts["embedding"])


def train_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    counts = param_counts(model)
    return flops_per_token(counts["active"], counts["embedding"], model.tie_embeddings, model.n_layers, seq_len,
                           model.n_heads * model.head_size)


def target_budget(cfg: LifecycleConfig) -> dict[str, float]:
    """N, D and C of the pretrain run the ablations predict."""
    t = cfg.pretrain
    tokens = t.steps * t.global_batch_size * t.seq_len
    n = matmul_params(cfg.model)
    return {"params": n, "tokens": tokens, "flops": train_flops_per_token(cfg.model, t.seq_len) * tokens,
            "tokens_per_param": tokens / n}


def _kv_heads(n_heads: int, target: ModelConfig) -> int:
    """Keep the target's query heads per KV head where it divides; else the largest divisor below it."""
    group = target.n_heads // target.kv_heads
    want = max(1, round(n_heads / group))
    return max(d for d in range(1, want + 1) if n_heads % d == 0)


def proxy_model(target: ModelConfig, size: ProxySize) -> ModelConfig:
    """The target scaled in width (whole heads of the target's head size) and depth; the FFN keeps its
    ratio to the width; vocabulary, RoPE, norms and MoE routing stay as they are."""
    head = target.head_size
    if size.dim is not None:
        if size.dim % head:
            raise ValueError(f"ablations.sizes: dim={size.dim} is not a multiple of the target head size {head}")
        dim = size.dim
    else:
        dim = max(head, round(size.width * target.dim / head) * head)
    n_layers = size.n_layers if size.n_layers is not None else max(1, round(size.depth * target.n_layers))
    n_heads = dim // head
    scale = dim / target.dim
    ffn = max(8, round(target.ffn_dim * scale / 8) * 8)
    update: dict[str, Any] = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads,
                              "n_kv_heads": _kv_heads(n_heads, target), "ffn_dim": ffn}
    if target.head_dim is not None:
        update["head_dim"] = head
    if target.moe is not None and target.moe.ffn_dim is not None:
        update["moe"] = target.moe.model_copy(update={"ffn_dim": max(8, round(target.moe.ffn_dim * scale / 8) * 8)})
    return ModelConfig.model_validate({**target.model_dump(), **update})


@dataclass(frozen=True)
class ProxyPoint:
    """One proxy run: its shape, its training settings and what it costs."""

    name: str
    size: str  # e.g. "d64-l2": points of one size share it
    model: dict
    train: dict  # a full TrainConfig dump (the job's `pretrain:` section)
    params: int  # N (matmul parameters)
    tokens: int  # D = steps x global batch x seq_len
    flops: float  # C
    budget: int = 0  # the nominal token budget D was rounded from (groups points across batch sizes)
    axes: dict = field(default_factory=dict)  # lr, global_batch_size, schedule, mixture (a name or None)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProxyPoint":
        return cls(**d)


def _steps_for(budget: float, tokens_per_step: int, lo: int, hi: int | None) -> int:
    steps = max(lo, math.ceil(budget / tokens_per_step))
    return min(steps, hi) if hi is not None else steps


def sweep_settings(cfg: LifecycleConfig) -> list[dict[str, Any]]:
    """The axis values of every point (before crossing with sizes and budgets). `mixture` is the name of
    one of `ablations.sweep.mixtures`, or None for pretrain's own (`pretrain.data_mixture`)."""
    sweep, t = cfg.ablations.sweep, cfg.pretrain
    if sweep.mode == "list":
        return [{"lr": p.lr or t.lr, "global_batch_size": p.global_batch_size or t.global_batch_size,
                 "schedule": p.schedule or t.schedule, "mixture": p.mixture} for p in sweep.points]
    lrs = sweep.lr or [t.lr]
    batches = sweep.global_batch_size or [t.global_batch_size]
    schedules = sweep.schedule or [t.schedule]
    mixtures = [m.name for m in sweep.mixtures] or [None]
    return [{"lr": lr, "global_batch_size": b, "schedule": s, "mixture": m}
            for lr, b, s, m in itertools.product(lrs, batches, schedules, mixtures)]


def mixture_weights(cfg: LifecycleConfig, name: str | None) -> dict[str, float] | None:
    """The weights a point trains with: the named sweep mixture, or pretrain's own (None: the packed mix)."""
    if name is None:
        return cfg.pretrain.data_mixture
    return dict(next(m.weights for m in cfg.ablations.sweep.mixtures if m.name == name))


def proxy_train(cfg: LifecycleConfig, steps: int, axes: dict[str, Any]) -> TrainConfig:
    """pretrain: with the proxy's steps and swept values; validation only at the end, no checkpoints."""
    t = cfg.pretrain
    gbs = int(axes["global_batch_size"])
    micro = math.gcd(gbs, t.micro_batch_size)
    warmup = min(steps, round(cfg.ablations.warmup_fraction * steps))
    return TrainConfig.model_validate({
        **t.model_dump(), "steps": steps, "lr": float(axes["lr"]), "global_batch_size": gbs, "micro_batch_size": micro,
        "schedule": axes["schedule"], "warmup_steps": warmup, "eval_every": 0,
        "data_mixture": mixture_weights(cfg, axes.get("mixture")),
        "eval_batches": cfg.ablations.eval_batches or t.eval_batches,
        "checkpoint": {**t.checkpoint.model_dump(), "every": 0, "async_save": False},
    })


def plan_sweep(cfg: LifecycleConfig) -> list[ProxyPoint]:
    """Every proxy of the sweep, smallest size first."""
    a, seq = cfg.ablations, cfg.pretrain.seq_len
    target = target_budget(cfg)
    models: dict[str, ModelConfig] = {}
    for size in a.sizes:
        m = proxy_model(cfg.model, size)
        models.setdefault(f"d{m.dim}-l{m.n_layers}", m)
    points = []
    for label, m in sorted(models.items(), key=lambda kv: matmul_params(kv[1])):
        n = matmul_params(m)
        ratio = target["tokens_per_param"] if a.tokens_per_param == "target" else a.tokens_per_param
        budgets = [ratio * n] if ratio is not None else [float(b) for b in a.token_budgets]
        for budget, axes in itertools.product(budgets, sweep_settings(cfg)):
            per_step = axes["global_batch_size"] * seq
            steps = _steps_for(budget, per_step, a.min_steps, a.max_steps)
            train = proxy_train(cfg, steps, axes)
            tokens = steps * per_step
            name = f"{label}-t{tokens}-lr{axes['lr']:.3g}-b{axes['global_batch_size']}-{axes['schedule']}"
            if axes.get("mixture") is not None:
                name += f"-m{axes['mixture']}"
            points.append(ProxyPoint(name=name, size=label, model=m.model_dump(mode="json"),
                                     train=train.model_dump(mode="json"), params=n, tokens=tokens,
                                     flops=train_flops_per_token(m, seq) * tokens, budget=round(budget),
                                     axes=dict(axes)))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise ValueError(f"ablations: the sweep repeats proxies {sorted({x for x in names if names.count(x) > 1})}")
    return points


def proxy_config(cfg: LifecycleConfig, point: ProxyPoint) -> LifecycleConfig:
    """The whole config a proxy job runs with: the proxy model and training section, one process, no
    per-job pre-flight check (a sweep is many short jobs on a machine the stage already checked)."""
    parallel = ParallelConfig(backend=cfg.parallel.backend, collective_timeout_s=cfg.parallel.collective_timeout_s)
    return LifecycleConfig.model_validate({
        **cfg.model_dump(mode="json"), "model": point.model, "pretrain": point.train,
        "parallel": parallel.model_dump(mode="json"), "infra": {**cfg.infra.model_dump(mode="json"), "health_check": False},
    })


def proxy_section(cfg: LifecycleConfig, point: ProxyPoint) -> dict:
    """What a proxy's fingerprint hashes: everything that changes its result and nothing else, so a
    widened sweep re-uses every proxy it already trained."""
    # data_mixture joins the hash only when set, so proxies trained before the field existed stay cached.
    train = {k: v for k, v in point.train.items() if not (k == "data_mixture" and v is None)}
    return {"seed": cfg.seed, "model": point.model, "train": train, "device": cfg.infra.device}
