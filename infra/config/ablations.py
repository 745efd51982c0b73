"""`ablations:` proxy models, their token budgets, the sweep axes, and whether pretrain takes the choice.

Seed: "Data mixture, learning rate, batch size and architecture are chosen with ablations on small
proxy models and scaling laws fitted to them. The big run should hold no surprises." Proxies are the
target `model:` scaled in width and depth; each trains on the packed `tokens` artifact at the
pretrain sequence length (the shards are packed at it), for a token budget given by a
tokens-per-parameter ratio (Chinchilla-style) or an explicit list of budgets.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section
from .train import check_weights


class ProxySize(Section):
    """One proxy shape: a fraction of the target's width and depth, or explicit numbers."""

    width: float = Field(0.5, gt=0, le=1, description="dim = width * model.dim, rounded to a multiple of the head size")
    depth: float = Field(0.5, gt=0, le=1, description="n_layers = max(1, round(depth * model.n_layers))")
    dim: int | None = Field(None, ge=1, description="explicit width (overrides `width`); a multiple of the head size")
    n_layers: int | None = Field(None, ge=1, description="explicit depth (overrides `depth`)")


class MixtureConfig(Section):
    """A named data mixture: weights over `data.sources` names (relative shares of training rows; a source
    left out gets 0)."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="label in proxy names, plots and choice.json")
    weights: dict[str, float] = Field(..., description="source name -> weight >= 0, not all 0")

    @model_validator(mode="after")
    def _weights(self) -> "MixtureConfig":
        check_weights(f"ablations.sweep.mixtures[{self.name}].weights", self.weights)
        return self


class SweepPoint(Section):
    """One explicit point of a `mode: list` sweep; unset axes take the pretrain value."""

    lr: float | None = Field(None, gt=0)
    global_batch_size: int | None = Field(None, ge=1)
    schedule: Literal["cosine", "wsd", "constant"] | None = None
    mixture: str | None = Field(None, description="name of one of `sweep.mixtures`")


class SweepConfig(Section):
    """The axes crossed with every proxy size. Empty axes take the pretrain value."""

    mode: Literal["grid", "list"] = Field("grid", description="grid: the cross product of the axes; list: `points`")
    lr: list[float] = Field(default_factory=list, description="peak learning rates")
    global_batch_size: list[int] = Field(default_factory=list, description="sequences per optimizer step")
    schedule: list[Literal["cosine", "wsd", "constant"]] = Field(default_factory=list)
    mixtures: list[MixtureConfig] = Field(
        default_factory=list,
        description="data mixtures (grid: crossed with the other axes; list: named by points); empty: pretrain's",
    )
    points: list[SweepPoint] = Field(default_factory=list, description="mode=list: explicit points")

    @model_validator(mode="after")
    def _axes(self) -> "SweepConfig":
        if any(v <= 0 for v in self.lr):
            raise ValueError(f"ablations.sweep.lr={self.lr}: learning rates must be > 0")
        if any(v < 1 for v in self.global_batch_size):
            raise ValueError(f"ablations.sweep.global_batch_size={self.global_batch_size}: batch sizes must be >= 1")
        for name in ("lr", "global_batch_size", "schedule"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"ablations.sweep.{name}={values}: repeated values")
        names = [m.name for m in self.mixtures]
        if len(set(names)) != len(names):
            raise ValueError(f"ablations.sweep.mixtures: repeated names {sorted({n for n in names if names.count(n) > 1})}")
        missing = sorted({p.mixture for p in self.points if p.mixture is not None} - set(names))
        if missing:
            raise ValueError(f"ablations.sweep.points name mixture(s) {missing} not in ablations.sweep.mixtures {names}")
        if self.mode == "list" and not self.points:
            raise ValueError("ablations.sweep.mode=list needs `points`")
        if self.mode == "grid" and self.points:
            raise ValueError("ablations.sweep.points is only read with mode=list")
        return self


class AblationsConfig(Section):
    enabled: bool = Field(True, description="false: commit an empty choice and train no proxies (pretrain keeps its values)")
    sizes: list[ProxySize] = Field(
        default_factory=lambda: [ProxySize(width=w, depth=w) for w in (0.25, 0.375, 0.5, 0.75)],
        description="proxy shapes, derived from `model:`",
    )
    tokens_per_param: float | Literal["target"] | None = Field(
        "target",
        description="token budget D = ratio * N (N: parameters that cost FLOPs, i.e. without the embedding lookup); "
        "'target' uses the pretrain run's own D/N so proxies lie on the same ray as the run they predict; "
        "None: use `token_budgets`",
    )
    token_budgets: list[int] = Field(
        default_factory=list, description="explicit token budgets, each crossed with every size (the N/D fit needs >1)"
    )
    min_steps: int = Field(10, ge=1, description="fewer steps than this are raised to it (budgets too small to train)")
    max_steps: int | None = Field(None, ge=1, description="cap on a proxy's steps (keeps a laptop sweep short)")
    warmup_fraction: float = Field(0.1, ge=0, lt=1, description="warmup steps as a share of each proxy's steps")
    sweep: SweepConfig = Field(default_factory=lambda: SweepConfig(lr=[1e-3, 3e-3, 1e-2]))
    eval_batches: int | None = Field(None, ge=1, description="validation batches per proxy; default pretrain.eval_batches")
    concurrency: int | None = Field(
        None, ge=1, description="proxies trained at once; default: CPU cores / threads_per_proxy (1 on a GPU machine)"
    )
    threads_per_proxy: int = Field(1, ge=1, description="OMP threads of each CPU proxy job")
    use_ablations: bool = Field(True, description="pretrain takes the chosen lr, batch size, schedule and data mixture from choice.json")
    pinned: list[Literal["lr", "global_batch_size", "schedule", "data_mixture"]] = Field(
        default_factory=list, description="pretrain values kept as configured even when use_ablations is on"
    )
    lr_transfer: Literal["extrapolate", "largest"] = Field(
        "extrapolate",
        description="extrapolate: fit log(best lr) against log(N) over sizes and evaluate it at the target's N; "
        "largest: the best lr of the largest proxy",
    )

    @model_validator(mode="after")
    def _budgets(self) -> "AblationsConfig":
        if not self.sizes:
            raise ValueError("ablations.sizes is empty: name at least one proxy size")
        if self.tokens_per_param is None and not self.token_budgets:
            raise ValueError("ablations: set tokens_per_param or token_budgets")
        if isinstance(self.tokens_per_param, float) and self.tokens_per_param <= 0:
            raise ValueError(f"ablations.tokens_per_param={self.tokens_per_param} must be > 0")
        if self.tokens_per_param is not None and self.token_budgets:
            raise ValueError("ablations: tokens_per_param and token_budgets exclude each other (set one to null/[])")
        if any(b < 1 for b in self.token_budgets):
            raise ValueError(f"ablations.token_budgets={self.token_budgets}: budgets must be >= 1 token")
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ValueError(f"ablations.max_steps={self.max_steps} is below min_steps={self.min_steps}")
        return self


def check_mixture_sources(ablations: AblationsConfig, data_sources: list[str], pretrain_mixture: dict | None) -> None:
    """Every mixture weight names a `data.sources` entry (called by the root config's cross-section check)."""
    named = [(f"ablations.sweep.mixtures[{m.name}]", m.weights) for m in ablations.sweep.mixtures]
    if pretrain_mixture is not None:
        named.append(("pretrain.data_mixture", pretrain_mixture))
    for field, weights in named:
        unknown = sorted(set(weights) - set(data_sources))
        if unknown:
            raise ValueError(f"{field}: unknown source name(s) {unknown}; data.sources names {data_sources}")
