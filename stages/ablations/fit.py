"""Fits over proxy results (scipy): the best learning rate of one size, the compute power law
L(C) = a * C^-b + E (Kaplan et al. 2020; Hoffmann et al. 2022, approach 3 along a fixed D/N ray), the
N/D form L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, eq. 2) when budgets vary, and the
drift of the best learning rate with size. Predictions carry a standard deviation from the fit's
covariance by the delta method (the gradient of the prediction with respect to the parameters).

Inputs are normalised (C / C0, N / N0, D / D0 with the geometric means) so the optimiser sees numbers
near 1; the reported parameters are converted back to raw units.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit


class FitError(ValueError):
    """Too few usable points, or the optimiser did not converge; the message says which."""


# ------------------------------------------------------------------------------------ best learning rate


@dataclass
class BestLR:
    lr: float
    loss: float
    method: str  # "parabola" (vertex of a quadratic in log lr) or "best" (the lowest measured point)
    curvature: float | None = None  # the quadratic's coefficient of log(lr)^2
    measured_loss: float = math.nan  # the lowest loss a run actually reached

    def as_dict(self) -> dict:
        return asdict(self)


def best_lr(lrs: Sequence[float], losses: Sequence[float]) -> BestLR:
    """The learning rate with the lowest loss. With three or more finite points a parabola in log(lr)
    through the best point and up to two neighbours each side gives a vertex between measured rates;
    when it opens downwards or its vertex falls outside the points it was fitted on (the optimum lies
    beyond the sweep), the best measured point is taken instead."""
    pairs = sorted((float(lr), float(l)) for lr, l in zip(lrs, losses) if math.isfinite(l))
    if not pairs:
        raise FitError("best_lr: no finite loss (every run diverged)")
    x = np.log([p[0] for p in pairs])
    y = np.array([p[1] for p in pairs])
    i = int(np.argmin(y))
    best = BestLR(lr=pairs[i][0], loss=pairs[i][1], method="best", measured_loss=pairs[i][1])
    lo, hi = max(0, i - 2), min(len(x), i + 3)
    if hi - lo < 3 or i in (0, len(x) - 1):  # the minimum sits on the sweep's edge: no bracket
        return best
    c2, c1, c0 = np.polyfit(x[lo:hi], y[lo:hi], 2)
    if c2 <= 0:
        return best
    xv = -c1 / (2 * c2)
    if not x[lo] <= xv <= x[hi - 1]:
        return best
    return BestLR(lr=float(np.exp(xv)), loss=float(c0 + c1 * xv + c2 * xv * xv), method="parabola", curvature=float(c2),
                  measured_loss=pairs[i][1])


# ----------------------------------------------------------------------------------------- uncertainty


def delta_std(f: Callable[[np.ndarray], float], params: np.ndarray, cov: np.ndarray) -> float:
    """sqrt(g^T cov g) with g the central-difference gradient of f at params."""
    if cov is None or not np.all(np.isfinite(cov)):
        return math.inf
    g = np.zeros(len(params))
    for k in range(len(params)):
        h = 1e-6 * max(1.0, abs(params[k]))
        up, down = params.copy(), params.copy()
        up[k] += h
        down[k] -= h
        g[k] = (f(up) - f(down)) / (2 * h)
    var = float(g @ cov @ g)
    return math.sqrt(max(var, 0.0))


def _geomean(v: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(v))))


# ------------------------------------------------------------------------------------ L(C) power law


@dataclass
class PowerLawFit:
    """L(C) = a * C^-b + E in raw units; `cov` is over (a_n, b, E) with a_n = a * C0^-b."""

    a: float
    b: float
    E: float
    C0: float
    params: list[float]  # (a_n, b, E)
    cov: list[list[float]]
    points: int
    rmse: float

    @staticmethod
    def _f(x, a_n, b, E):
        return a_n * np.power(x, -b) + E

    def predict(self, C: float) -> tuple[float, float]:
        """(loss, standard deviation) at compute C."""
        p = np.array(self.params)
        f = lambda q: float(self._f(C / self.C0, *q))  # noqa: E731
        return f(p), delta_std(f, p, np.array(self.cov))

    def as_dict(self) -> dict:
        return asdict(self)


def _best_of_starts(f, x, y: np.ndarray, starts: list[list[float]], bounds, maxfev: int, what: str):
    """Bounded least squares from each start; the (params, covariance, sse) of the lowest sse."""
    best = None
    for p0 in starts:
        try:
            with warnings.catch_warnings():  # too few points for a covariance: the caller reports it
                warnings.simplefilter("ignore", OptimizeWarning)
                p, cov = curve_fit(f, x, y, p0=p0, bounds=bounds, maxfev=maxfev)
        except (RuntimeError, ValueError):
            continue
        sse = float(np.sum((f(x, *p) - y) ** 2))
        if best is None or sse < best[2] - 1e-15:
            best = (p, cov, sse)
    if best is None:
        raise FitError(f"{what}: the optimiser did not converge from any start")
    return best


def fit_power_law(C: Sequence[float], L: Sequence[float]) -> PowerLawFit:
    """Least squares of L = a * C^-b + E with a > 0, 0 < b < 3, 0 <= E < min(L). Four or more points
    give a covariance (three determine the curve exactly and leave no residual to scale it)."""
    C, L = np.asarray(C, float), np.asarray(L, float)
    keep = np.isfinite(L) & (C > 0)
    C, L = C[keep], L[keep]
    if len(C) < 3 or len(np.unique(C)) < 3:
        raise FitError(f"power law L(C) needs >= 3 distinct compute values, got {len(np.unique(C))}")
    C0 = _geomean(C)
    x = C / C0
    lmin = float(L.min())
    # a few starts: the E-b valley is long and flat
    starts = [[max(float(L.max()) - E0, 1e-3), 0.3, E0] for E0 in (f * lmin for f in (0.0, 0.5, 0.8, 0.95))]
    p, cov, sse = _best_of_starts(PowerLawFit._f, x, L, starts, ([1e-12, 1e-4, 0.0], [np.inf, 3.0, lmin]), 20000,
                                  "power law L(C)")
    if len(C) <= 3:  # three points: no covariance
        cov = np.full((3, 3), np.inf)
    a_n, b, E = (float(v) for v in p)
    return PowerLawFit(a=a_n * C0**b, b=b, E=E, C0=C0, params=[a_n, b, E], cov=np.asarray(cov).tolist(),
                       points=len(C), rmse=math.sqrt(sse / len(C)))


# --------------------------------------------------------------------------------------- L(N, D) form


@dataclass
class ChinchillaFit:
    """L(N, D) = E + A / N^alpha + B / D^beta in raw units; `cov` over (E, A_n, alpha, B_n, beta)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    N0: float
    D0: float
    params: list[float]
    cov: list[list[float]]
    points: int
    rmse: float

    @staticmethod
    def _f(nd, E, A_n, alpha, B_n, beta):
        n, d = nd
        return E + A_n * np.power(n, -alpha) + B_n * np.power(d, -beta)

    def predict(self, N: float, D: float) -> tuple[float, float]:
        p = np.array(self.params)
        nd = (np.array([N / self.N0]), np.array([D / self.D0]))
        f = lambda q: float(self._f(nd, *q)[0])  # noqa: E731
        return f(p), delta_std(f, p, np.array(self.cov))

    def as_dict(self) -> dict:
        return asdict(self)


def fit_chinchilla(N: Sequence[float], D: Sequence[float], L: Sequence[float]) -> ChinchillaFit:
    """Least squares of the N/D form; needs more points than its five parameters and at least two
    distinct N and two distinct D."""
    N, D, L = (np.asarray(v, float) for v in (N, D, L))
    keep = np.isfinite(L)
    N, D, L = N[keep], D[keep], L[keep]
    if len(L) < 6 or len(np.unique(N)) < 2 or len(np.unique(D)) < 2:
        raise FitError(f"L(N, D) needs >= 6 points over >= 2 sizes and >= 2 budgets, got {len(L)} points, "
                       f"{len(np.unique(N))} sizes, {len(np.unique(D))} budgets")
    N0, D0 = _geomean(N), _geomean(D)
    nd = (N / N0, D / D0)
    lmin, spread = float(L.min()), float(L.max() - L.min()) + 1e-3
    starts = [[E0, (lmin - E0) / 2 + spread / 2, 0.3, (lmin - E0) / 2 + spread / 2, 0.3]
              for E0 in (f * lmin for f in (0.0, 0.5, 0.9))]
    p, cov, sse = _best_of_starts(ChinchillaFit._f, nd, L, starts,
                                  ([0.0, 1e-12, 1e-4, 1e-12, 1e-4], [lmin, np.inf, 3.0, np.inf, 3.0]), 40000, "L(N, D)")
    E, A_n, alpha, B_n, beta = (float(v) for v in p)
    return ChinchillaFit(E=E, A=A_n * N0**alpha, alpha=alpha, B=B_n * D0**beta, beta=beta, N0=N0, D0=D0,
                         params=[E, A_n, alpha, B_n, beta], cov=np.asarray(cov).tolist(), points=len(L),
                         rmse=math.sqrt(sse / len(L)))


# ------------------------------------------------------------------------------ learning-rate transfer


@dataclass
class LRTransfer:
    """log(lr*) = intercept + slope * log(N), fitted over sizes; `lr` is its value at the target's N,
    clipped into the swept range (beyond it the data says nothing)."""

    lr: float
    raw_lr: float
    slope: float | None
    intercept: float | None
    clipped: bool
    method: str  # "extrapolate" | "largest"

    def as_dict(self) -> dict:
        return asdict(self)


def transfer_lr(sizes: Sequence[float], best_lrs: Sequence[float], target_n: float, lr_range: tuple[float, float],
                method: str = "extrapolate") -> LRTransfer:
    sizes, lrs = np.asarray(sizes, float), np.asarray(best_lrs, float)
    order = np.argsort(sizes)
    sizes, lrs = sizes[order], lrs[order]
    if method == "largest" or len(np.unique(sizes)) < 2:
        lr = float(lrs[-1])
        return LRTransfer(lr=lr, raw_lr=lr, slope=None, intercept=None, clipped=False, method="largest")
    slope, intercept = np.polyfit(np.log(sizes), np.log(lrs), 1)
    raw = float(np.exp(intercept + slope * math.log(target_n)))
    lo, hi = lr_range
    lr = min(max(raw, lo), hi)
    return LRTransfer(lr=lr, raw_lr=raw, slope=float(slope), intercept=float(intercept), clipped=lr != raw,
                      method="extrapolate")
