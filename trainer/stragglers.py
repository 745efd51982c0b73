"""Straggler detection (seed: "... and stragglers, the slowest GPU that every collective waits for").

What is measured, per rank and step: the time from the start of the step's first forward (a forward
pre-hook on the model) to the end of its last backward (an autograd final callback, queued from a hook
on the forward's output when the backward reaches it, so it runs before DDP's own end-of-backward
callback that waits for the gradient all-reduces). That window holds the rank's forward and backward
compute of all its micro-batches and leaves out the waits that make a fast rank look as slow as the
slowest one: the step's token-count all-reduce before the first forward (where ranks wait for a peer
still logging or loading data), DDP's wait for the last gradient buckets, ZeRO-1's reduce-scatter and
the optimizer step after the backward, and the spike guard's all-reduces. On CPU the clock is wall
time (`perf_counter`); on CUDA two events on the current stream, so it is GPU time of the compute
stream, which under DDP never waits on the NCCL stream inside that window.

At logged steps every rank puts the mean of its windows since the previous logged step in its own slot
of a world-sized vector and one all-reduce (sum, world group) gives every rank all of them; rank 0 logs
`straggler/slowest_rank`, `straggler/compute_s_max`, `straggler/compute_s_median` and
`straggler/ratio` (max / median: 1.0 when ranks are even; with 2 ranks it cannot exceed 2).

Limits: (1) collectives issued *inside* forward or backward are in the window: FSDP2's all-gathers and
reduce-scatters, tensor/context/expert-parallel collectives; there a slow rank's peers in the same group
wait inside their own windows, so the figure still separates slow data-parallel replicas but not ranks
within one model-parallel group. (2) Pipeline parallel runs its own schedule and never calls the root
module's forward, so nothing is measured (no metrics). (3) Wall time on a shared CPU counts time the OS
gave to other processes: noise on a loaded machine, real slowness on a dedicated one. (4) Work outside
the window (data loading, rank 0's logging, checkpoint staging) can also make others wait; it shows in
`tokens_per_s`, not here.

Off on one process, and off unless `pretrain.straggler_detection` is set. Cost: two hooks on the root
module, one tensor hook and one callback per backward (~15 us per micro-batch on CPU: 1.5% of the tiny
test model's 13 ms step of 4 micro-batches), and one all-reduce of `world_size` floats per logged step
(~0.3 ms on 2 gloo ranks); nothing measurable next to a real model's step of seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def _grad_tensors(x) -> list[torch.Tensor]:
    """Tensors that require grad in a module output (tensor, list/tuple/dict, dataclass such as TokenLoss)."""
    if isinstance(x, torch.Tensor):
        return [x] if x.requires_grad else []
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _grad_tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _grad_tensors(item)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in _grad_tensors(getattr(x, f.name))]
    return []


def summarize(compute_s: list[float]) -> dict[str, float]:
    """The logged figures from every rank's compute seconds (index = rank)."""
    if not compute_s:
        raise ValueError("summarize: no ranks' compute times given")
    slowest = max(range(len(compute_s)), key=compute_s.__getitem__)
    median = statistics.median(compute_s)
    return {
        "straggler/slowest_rank": float(slowest),
        "straggler/compute_s_max": compute_s[slowest],
        "straggler/compute_s_median": median,
        "straggler/ratio": compute_s[slowest] / median if median > 0 else float("inf"),
    }


class ComputeClock:
    """Times each step's window from the first forward to the end of the last backward (see the module
    docstring) on one rank; `mean_s()` is the mean per step since the last call (None: nothing timed)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._active = self._queued = False
        self._start = self._end = None
        self._pending: list[tuple] = []  # CUDA (start, end) event pairs not read yet
        self._sum, self._n = 0.0, 0
        self._handles = [model.register_forward_pre_hook(self._on_forward),
                         model.register_forward_hook(self._on_output)]

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def _on_forward(self, module, args):
        if self._active and self._start is None:
            self._start = self._now()

    def _on_output(self, module, args, output):
        if self._active:
            for t in _grad_tensors(output):
                t.register_hook(self._on_backward)

    def _on_backward(self, grad):
        if self._active and not self._queued:  # once per backward; runs after the graph's last node
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self):
        self._queued = False
        self._end = self._now()

    @contextlib.contextmanager
    def step(self):
        self._start = self._end = None
        self._active, self._queued = True, False
        try:
            yield
        finally:
            self._active = False
        if self._start is None or self._end is None:
            return  # no forward/backward through the root module this step (pipeline parallel)
        if self.cuda:
            self._pending.append((self._start, self._end))
        else:
            self._sum += self._end - self._start
            self._n += 1

    def mean_s(self) -> float | None:
        for start, end in self._pending:
            end.synchronize()
            self._sum += start.elapsed_time(end) / 1000.0
            self._n += 1
        self._pending.clear()
        mean = self._sum / self._n if self._n else None
        self._sum, self._n = 0.0, 0
        return mean

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class Stragglers:
    """The trainer's hook: `with stragglers.step():` around a train step, `exchange(logged)` after it
    on every rank (a collective when `logged`) returns the figures to log (empty when off)."""

    def __init__(self, model: nn.Module, device: torch.device, enabled: bool = True):
        self.enabled = enabled and dist.is_initialized() and dist.get_world_size() > 1
        self.device = device
        self.clock = ComputeClock(model, device) if self.enabled else None

    def step(self):
        return self.clock.step() if self.clock is not None else contextlib.nullcontext()

    def exchange(self, logged: bool) -> dict[str, float]:
        """Every rank calls this after every step; at logged steps it is one all-reduce over the world
        of each rank's mean compute seconds per step since the previous logged step."""
        if self.clock is None or not logged:
            return {}
        mean = self.clock.mean_s()
        slots = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=self.device)
        slots[dist.get_rank()] = -1.0 if mean is None else mean
        dist.all_reduce(slots)
        values = slots.tolist()
        if min(values) < 0:  # some rank timed nothing (pipeline parallel): nothing to compare
            return {}
        return summarize(values)

    def close(self) -> None:
        if self.clock is not None:
            self.clock.close()
