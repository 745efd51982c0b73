"""Measuring a pipeline schedule: when every forward and backward ran on this rank and how many
micro-batches each stage held at once, for the bubble and in-flight figures (tests/parallel/test_par2_layouts.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PipelineTrace:
    """Timestamps of every forward/backward this rank ran, and the live micro-batches per chunk.

    `delay_s` = (forward, backward) seconds added to each pass of a whole-model-sized chunk (divided
    by the chunks per rank), so a measurement reflects the schedule's dependencies rather than a
    busy machine's noise; (0, 0) measures the real passes."""

    delay_s: tuple[float, float] = (0.0, 0.0)
    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # kind, stage, mb, t0, t1
    live: dict[int, int] = field(default_factory=dict)
    peak_live: dict[int, int] = field(default_factory=dict)
    window: tuple[float, float] = (0.0, 0.0)

    def reset(self) -> None:
        self.events.clear()
        self.live.clear()
        self.peak_live.clear()

    def idle_fraction(self) -> float:
        t0, t1 = self.window
        busy = sum(e[4] - e[3] for e in self.events)
        return 1.0 - busy / (t1 - t0) if t1 > t0 else 0.0


def instrument_stage(stage, trace: PipelineTrace, chunks_per_rank: int) -> None:
    """Wrap a PipelineStage's passes so each records its kind, stage, micro-batch and times (plus the
    trace's fixed delays)."""
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
    bwd_w = getattr(stage, "backward_weight_one_chunk", None)
    sid = stage.stage_index
    f_delay, b_delay = (d / chunks_per_rank for d in trace.delay_s)

    def forward_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.perf_counter()
        out = fwd(chunk_id, *args, **kwargs)
        if f_delay:
            time.sleep(f_delay)
        trace.events.append(("F", sid, chunk_id, t0, time.perf_counter()))
        trace.live[sid] = trace.live.get(sid, 0) + 1
        trace.peak_live[sid] = max(trace.peak_live.get(sid, 0), trace.live[sid])
        return out

    def backward_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.perf_counter()
        out = bwd(chunk_id, *args, **kwargs)
        if b_delay:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            time.sleep(b_delay if full else b_delay / 2)  # input-only backward: the W pass does the rest
        trace.events.append(("B", sid, chunk_id, t0, time.perf_counter()))
        trace.live[sid] -= 1
        return out

    def backward_weight_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.perf_counter()
        out = bwd_w(chunk_id, *args, **kwargs)
        if b_delay:
            time.sleep(b_delay / 2)
        trace.events.append(("W", sid, chunk_id, t0, time.perf_counter()))
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    if bwd_w is not None:
        stage.backward_weight_one_chunk = backward_weight_one_chunk
