"""GRPO's verifiable rewards, `module:function(answer, expected) -> float` (posttrain.grpo.reward).

`exact` is the task family's checker as 1.0 / 0.0. `closeness` keeps 1.0 for an exact answer and gives a
wrong integer answer partial credit that falls with its distance, 0.5 / (1 + |got - expected|): a tiny
model's wrong answers are mostly near misses, so with exact match alone most groups of G samples are
all wrong (advantage 0, nothing to learn), while with closeness almost every group ranks its samples and
the gradient points at the right number. Still decided by code from the expected answer, never by a
model (the seed's "a checker decides whether an answer is right")."""

from __future__ import annotations

from stages.evaluate.task_family import check, extract_answer


def exact(answer: str, expected: str) -> float:
    return 1.0 if check(answer, expected) else 0.0


def closeness(answer: str, expected: str) -> float:
    if check(answer, expected):
        return 1.0
    try:
        got, want = int(extract_answer(answer)), int(expected.strip())
    except ValueError:
        return 0.0  # not a number at all: no credit
    return 0.5 / (1.0 + abs(got - want))
