"""Gates from config: an absolute bound on a variant's metric, or the most it may lose against a
baseline variant ("grpo must not lose more than 0.05 bits per byte vs pretrain"). "Loss" follows the
metric's direction, so a rise in perplexity and a drop in accuracy are both losses. Every failing
gate is reported at once, each naming the variant, task, metric, values and the gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config.evaluate import GateConfig


class GateFailed(RuntimeError):
    """One or more evaluation gates failed; `failures` holds one GateResult per failing gate."""

    def __init__(self, failures: list["GateResult"]):
        self.failures = failures
        lines = [f"{len(failures)} evaluation gate(s) failed:"] + [f"  - {f.message}" for f in failures]
        super().__init__("\n".join(lines))


@dataclass
class GateResult:
    gate: GateConfig
    variant: str
    passed: bool
    value: float | None
    baseline_value: float | None
    message: str


def _describe(g: GateConfig) -> str:
    if g.baseline is not None:
        return (f"gate: {g.variant} may lose at most {g.max_loss:g}{' (relative)' if g.relative else ''} on "
                f"{g.task}/{g.metric} vs {g.baseline}")
    bounds = " and ".join(b for b in (f">= {g.min:g}" if g.min is not None else "",
                                      f"<= {g.max:g}" if g.max is not None else "") if b)
    return f"gate: {g.variant} {g.task}/{g.metric} {bounds}"


def _lookup(summaries: dict[str, Any], variant: str, g: GateConfig) -> dict[str, Any]:
    if variant not in summaries:
        raise ValueError(f"{_describe(g)}: variant {variant!r} was not evaluated (evaluated: {sorted(summaries)})")
    metrics = summaries[variant]["metrics"].get(g.task)
    if metrics is None:
        raise ValueError(f"{_describe(g)}: task {g.task!r} has no results for {variant!r} (tasks: "
                       f"{sorted(summaries[variant]['metrics'])})")
    if g.metric not in metrics:
        raise ValueError(f"{_describe(g)}: metric {g.metric!r} not in {g.task} (metrics: {sorted(metrics)})")
    return metrics[g.metric]


def evaluate_gate(g: GateConfig, summaries: dict[str, Any]) -> list[GateResult]:
    if g.variant == "*":
        variants = [v for v in summaries if v != g.baseline]
    else:
        variants = [g.variant]
    results = []
    for variant in variants:
        m = _lookup(summaries, variant, g)
        value = m["value"]
        where = f"variant {variant!r}, task {g.task}, metric {g.metric}"
        if g.baseline is not None:
            base = _lookup(summaries, g.baseline, g)["value"]
            loss = (base - value) if m["higher_is_better"] else (value - base)
            amount = loss / abs(base) if g.relative and base != 0 else loss
            passed = amount <= g.max_loss
            message = (f"{where}: {value:.6g} vs {g.baseline} {base:.6g}, a loss of {amount:.6g}"
                       f"{' (relative)' if g.relative else ''} > {g.max_loss:g} allowed ({_describe(g)})")
            results.append(GateResult(g, variant, passed, value, base, message))
        else:
            low = g.min is not None and value < g.min
            high = g.max is not None and value > g.max
            passed = not (low or high)
            bound = f"below the minimum {g.min:g}" if low else f"above the maximum {g.max:g}" if high else "within bounds"
            results.append(GateResult(g, variant, passed, value, None, f"{where}: {value:.6g} is {bound} ({_describe(g)})"))
    return results


def evaluate_gates(gates: list[GateConfig], summaries: dict[str, Any]) -> list[GateResult]:
    """Every gate's result, passed or not (the registry's aliases are set from them before a failure stops
    the stage)."""
    return [r for g in gates for r in evaluate_gate(g, summaries)]


def raise_failed(results: list[GateResult]) -> list[GateResult]:
    """GateFailed naming every failing result, else the results."""
    failed = [r for r in results if not r.passed]
    if failed:
        raise GateFailed(failed)
    return results


def check_gates(gates: list[GateConfig], summaries: dict[str, Any]) -> list[GateResult]:
    """Evaluate every gate; raise GateFailed naming all failures, else return the results."""
    return raise_failed(evaluate_gates(gates, summaries))
