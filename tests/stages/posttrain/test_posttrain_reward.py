"""GRPO's rewards: `exact` is the task family's checker as a number; `closeness` keeps 1.0 for the right
answer and ranks wrong integers by distance (hand-computed values), never rewarding non-numbers."""

import pytest

from stages.evaluate.task_family import check
from stages.posttrain.reward import closeness, exact


@pytest.mark.parametrize("answer, expected", [("54", "54"), (" 54\nmore", "54"), ("53", "54"), ("x", "54"), ("", "3")])
def test_exact_is_the_checker(answer, expected):
    assert exact(answer, expected) == (1.0 if check(answer, expected) else 0.0)


def test_closeness_by_hand():
    assert closeness("54", "54") == 1.0 and closeness(" 54\n", "54") == 1.0
    assert closeness("55", "54") == pytest.approx(0.25)  # 0.5 / (1 + 1)
    assert closeness("50", "54") == pytest.approx(0.1)  # 0.5 / (1 + 4)
    assert closeness("-3", "3") == pytest.approx(0.5 / 7)
    assert closeness("fifty", "54") == 0.0 and closeness("", "54") == 0.0
    # a wrong answer never earns what the right one does, and nearer always earns more
    assert all(closeness(str(54 + d), "54") < closeness(str(54 + d - (1 if d > 0 else -1)), "54") for d in (2, 3, -2, -5))
