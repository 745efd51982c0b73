"""Closed forms of the pipeline schedules (seed: the bubble), against which the measured schedule is
checked (tests/parallel/test_par2_layouts.py) and which the estimator's simulated timelines reproduce."""

from __future__ import annotations


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """(p - 1) / (v m + p - 1): GPipe and 1F1B at v = 1, interleaved with v chunks per rank."""
    return (p - 1) / (v * m + p - 1)


def expected_peak_in_flight(schedule: str, p: int, m: int, stage: int) -> int:
    """Micro-batches a stage holds at most: m for GPipe, min(m, p - i) for 1F1B stage i."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - stage)
    raise ValueError(f"no closed form here for {schedule}")
