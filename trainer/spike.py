"""Loss-spike detection (seed: "Watch the loss, the gradient norm ... Common responses: roll back to an
earlier checkpoint and skip the batches that caused the spike, lower the learning rate").

A step is a spike when its loss or its gradient norm is not finite, or sits more than `z_threshold`
rolling standard deviations above the rolling mean of the last `window` accepted steps (once
`min_history` steps were seen). Only accepted (applied) steps enter the history, so a spike does not
raise the bar for the next one. Every rank feeds the detector the same global loss and gradient norm,
and the loop still reduces the verdict (any rank's spike is everyone's), so all ranks skip together.

Responses, in order (trainer.recovery): skip the step without applying it; after `max_skips` skips in
a row, roll back to the last good checkpoint and skip the data window of the spiking steps, scaling
the LR by `lr_factor_on_rollback`; after `max_rollbacks` rollbacks, end `diverged`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from infra.config.train import SpikeConfig


@dataclass
class Verdict:
    spike: bool
    reason: str = ""


class SpikeDetector:
    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=cfg.window)

    def check(self, loss: float, grad_norm: float) -> Verdict:
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return Verdict(True, f"non-finite loss={loss} grad_norm={grad_norm}")
        if not self.cfg.enabled or len(self.losses) < self.cfg.min_history:
            return Verdict(False)
        for name, value, hist in (("loss", loss, self.losses), ("grad_norm", grad_norm, self.grad_norms)):
            z = zscore(value, hist)
            if z > self.cfg.z_threshold:
                return Verdict(True, f"{name}={value:.4g} is {z:.1f} std above the rolling mean {mean(hist):.4g}")
        return Verdict(False)

    def accept(self, loss: float, grad_norm: float) -> None:
        self.losses.append(float(loss))
        self.grad_norms.append(float(grad_norm))

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state.get("losses", []), maxlen=self.cfg.window)
        self.grad_norms = deque(state.get("grad_norms", []), maxlen=self.cfg.window)


def mean(xs) -> float:
    return sum(xs) / len(xs)


def zscore(x: float, xs) -> float:
    """(x - mean) / std of the history, with the std floored at 1% of |mean| so a flat history (std
    near 0) does not turn noise into spikes."""
    m = mean(xs)
    var = sum((v - m) ** 2 for v in xs) / max(1, len(xs) - 1)
    std = max(math.sqrt(var), 0.01 * abs(m), 1e-12)
    return (x - m) / std
