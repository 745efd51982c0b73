"""Straggler detection (trainer/stragglers.py): the timed window runs from the step's first forward to
the end of its last backward, so a wait before the forward or after the backward (where a fast rank
waits for a slow one in collectives) is left out and a slow forward or backward is counted; the
figures logged from every rank's time; off on one process. The two-rank check (a slowed rank is
reported slowest with ratio > 1.5, an even run below 1.5) rides on the torchrun launches of
tests/faults/test_faults_restart.py."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

from trainer.stragglers import ComputeClock, Stragglers, summarize


class Two(nn.Module):
    def __init__(self, backward_sleep: float):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.backward_sleep = backward_sleep

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: time.sleep(self.backward_sleep))  # a slow kernel in the backward
        return self.b(h).sum()


def test_window_is_first_forward_to_last_backward():
    model = Two(backward_sleep=0.04)
    model.register_forward_hook(lambda m, a, out: time.sleep(0.03))  # a slow forward
    clock = ComputeClock(model, torch.device("cpu"))
    x = torch.randn(4, 8)
    with clock.step():
        time.sleep(0.15)  # before the first forward: waiting for peers (the token all-reduce)
        for _ in range(2):  # two micro-batches: both forwards and backwards are in the window
            model(x).backward()
        time.sleep(0.15)  # after the last backward: DDP's wait for the gradient buckets, the optimizer
    measured = clock.mean_s()
    inside = 2 * (0.03 + 0.04)
    assert inside <= measured < inside + 0.1, measured
    assert clock.mean_s() is None  # the mean is of the steps since the last call
    with torch.no_grad(), clock.step():
        model(x)  # no backward (an evaluation): nothing timed
    assert clock.mean_s() is None
    clock.close()
    assert not model._forward_pre_hooks


def test_summary_figures():
    times = [0.11, 0.35, 0.10, 0.12]
    got = summarize(times)
    assert got["straggler/slowest_rank"] == 1.0
    assert got["straggler/compute_s_max"] == 0.35
    assert got["straggler/compute_s_median"] == pytest.approx(float(torch.tensor(times).quantile(0.5)))
    assert got["straggler/ratio"] == pytest.approx(0.35 / statistics.median(times))
    assert summarize([0.2, 0.2])["straggler/ratio"] == 1.0
    with pytest.raises(ValueError, match="no ranks"):
        summarize([])


def test_off_on_one_process():
    model = Two(backward_sleep=0.0)
    s = Stragglers(model, torch.device("cpu"), enabled=True)
    assert not s.enabled and not model._forward_hooks
    with s.step():
        model(torch.randn(2, 8)).backward()
    assert s.exchange(logged=True) == {}
