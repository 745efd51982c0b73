"""Pipeline schedules computed from their rules, then played on an ideal clock.

Each rank runs its own list of forward (F) and backward (B) passes over (micro-batch, chunk) pairs in
the order its schedule dictates; a pass starts when the rank is free and its inputs exist (F needs the
previous chunk's F of the same micro-batch, B the next chunk's B). Sends are free and every chunk costs
the same (F = 1/v, B = 2/v time units: backward computes two gradients per matmul), so the idle time
left is exactly the schedule's bubble. The tests hold it against the closed forms:

- GPipe and 1F1B: (p - 1) / (m + p - 1) of the step (Huang et al. 2019; Narayanan et al. 2019);
- interleaved 1F1B with v chunks per rank: the bubble *time* is divided by v (Narayanan et al. 2021),
  which as a share of the step is (p - 1) / (v*m + p - 1).

The same play-through gives each rank's peak count of micro-batches in flight (forwarded, not yet
backwarded): m on every GPipe stage, p - i on 1F1B stage i, and p*v + p - 1 chunks on the first rank of
an interleaved schedule, Korthikanti et al.'s factor (1 + (p - 1)/(p*v)) on its activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Pass:
    """One forward or backward pass of one micro-batch through one chunk (global chunk id c on rank c % p)."""

    kind: str  # "F" or "B"
    micro_batch: int
    chunk: int
    rank: int
    start: float = 0.0
    end: float = 0.0


@dataclass
class Timeline:
    """A played schedule: every pass with its start and end, per rank."""

    schedule: str
    p: int
    m: int
    v: int
    passes: list[Pass] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(x.end for x in self.passes) if self.passes else 0.0

    def busy(self, rank: int) -> float:
        return sum(x.end - x.start for x in self.passes if x.rank == rank)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step, measured from the timeline."""
        total = self.p * self.makespan
        return 1.0 - sum(self.busy(r) for r in range(self.p)) / total if total else 0.0

    def peak_held(self, rank: int, chunk_weights: list[float]) -> float:
        """Peak of a rank's held activations when chunk c's costs chunk_weights[c] (its layers, or bytes)."""
        events = []
        for x in self.passes:
            if x.rank == rank:
                w = chunk_weights[x.chunk]
                events.append((x.start, 1, w) if x.kind == "F" else (x.end, -1, -w))
        events.sort(key=lambda e: (e[0], e[1]))
        held = peak = 0.0
        for _, _, delta in events:
            held += delta
            peak = max(peak, held)
        return peak

    def peak_in_flight(self, rank: int) -> int:
        """Most (micro-batch, chunk) activations a rank holds at once: forwarded, backward not yet done."""
        return round(self.peak_held(rank, [1.0] * (self.p * self.v)))


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Share of the step a pipeline sits idle: (p - 1)/(m + p - 1), with the bubble time divided by v chunks."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    return (p - 1) / (v * m + p - 1)


def _order(schedule: str, rank: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """The (kind, micro_batch, global chunk) list one rank runs, by the schedule's rule."""
    if schedule == "gpipe":
        # All forwards, then all backwards (Huang et al.): every micro-batch's activations are held at once.
        return [("F", i, rank) for i in range(m)] + [("B", i, rank) for i in range(m)]
    if schedule == "1f1b":
        # Warm up with p - rank - 1 forwards, then alternate one forward and one backward (PipeDream-Flush).
        warmup = min(p - rank - 1, m)
        order = [("F", i, rank) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, rank), ("B", i, rank)]
        return order + [("B", i, rank) for i in range(m - warmup, m)]
    if schedule == "interleaved_1f1b":
        # Megatron's interleaved rule (Narayanan et al. 2021): virtual micro-batch k runs chunk (k // p) % v
        # of micro-batch (k // (p*v))*p + k % p; backwards walk the chunks in reverse.
        if m % p:
            raise ValueError(f"interleaved 1F1B needs micro-batches m={m} divisible by pipeline stages p={p}")
        total = m * v

        def f(k: int) -> tuple[str, int, int]:
            return ("F", (k // (p * v)) * p + k % p, ((k // p) % v) * p + rank)

        def b(k: int) -> tuple[str, int, int]:
            return ("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + rank)

        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        order = [f(k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [f(warmup + i), b(i)]
        return order + [b(k) for k in range(total - warmup, total)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}; simulated: {', '.join(SCHEDULES)}")


def play(schedule: str, p: int, m: int, v: int = 1, forward: float = 1.0, backward: float = 2.0) -> Timeline:
    """Run every rank's pass list on an ideal clock; `forward`/`backward` are one micro-batch's full-model times."""
    if schedule != "interleaved_1f1b":
        v = 1
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    chunks = p * v
    tf, tb = forward / v, backward / v
    orders = [_order(schedule, r, p, m, v) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    cursor = [0] * p
    timeline = Timeline(schedule, p, m, v)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while cursor[r] < len(orders[r]):
                kind, mb, c = orders[r][cursor[r]]
                if kind == "F":
                    deps = [("F", mb, c - 1)] if c > 0 else []
                else:
                    deps = [("F", mb, c)] + ([("B", mb, c + 1)] if c < chunks - 1 else [("F", mb, chunks - 1)])
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                end = start + (tf if kind == "F" else tb)
                done[(kind, mb, c)] = end
                clock[r] = end
                timeline.passes.append(Pass(kind, mb, c, r, start, end))
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} with p={p}, m={m}, v={v} deadlocked (a pass waits on one never run)")
    return timeline
