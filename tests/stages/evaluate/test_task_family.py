"""The verifiable task family: deterministic, disjoint splits, answers right by an independent
computation, and a checker that is exact."""

from __future__ import annotations

import operator

import pytest

from stages.evaluate.task_family import (
    KINDS, check, extract_answer, make_example, make_split, multiple_choice, split_of,
)


@pytest.mark.parametrize("kind", KINDS)
def test_make_split_is_deterministic_and_seeded(kind):
    a = make_split(kind, "heldout", 50, seed=3)
    b = make_split(kind, "heldout", 50, seed=3)
    c = make_split(kind, "heldout", 50, seed=4)
    assert [e.text for e in a] == [e.text for e in b]
    assert [e.text for e in a] != [e.text for e in c]
    assert len({e.question for e in a}) == 50
    # a longer request extends the shorter one (post-train can grow its set without reshuffling)
    assert [e.text for e in make_split(kind, "heldout", 60, seed=3)[:50]] == [e.text for e in a]


@pytest.mark.parametrize("kind", KINDS)
def test_train_and_heldout_never_share_a_problem(kind):
    train = {e.question for seed in range(3) for e in make_split(kind, "train", 400, seed)}
    held = {e.question for e in make_split(kind, "heldout", 200, seed=0)}
    assert not train & held
    assert all(split_of(kind, q) == "heldout" for q in held)


def test_arithmetic_answers_match_an_independent_computation():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    for e in make_split("arithmetic", "train", 300, seed=0):
        a, op, b = e.question.split()
        assert len(a) >= 2 and len(b) >= 1
        assert int(e.answer) == ops[op](int(a), int(b))
        assert e.prompt == f"Q: What is {e.question}?\nA:" and e.completion == " " + e.answer


def test_python_expr_answers_are_the_repr_of_the_value():
    for e in make_split("python_expr", "train", 300, seed=0):
        assert e.prompt == f">>> {e.question}\n"
        assert e.answer == repr(eval(e.question))  # noqa: S307 - our own generated expressions
        assert check(e.answer, e.answer)


@pytest.mark.parametrize("answer,expected,ok", [
    ("432", "432", True), (" 432 \nQ: next", "432", True), ("\n\n432", "432", True),
    ("433", "432", False), ("432.0", "432", False), ("0432", "432", False), ("-432", "432", False),
    ("4320", "432", False), ("", "432", False), ("432 apples", "432", False),
    ("[1,2,3]", "[1, 2, 3]", True), ("[1, 2]", "[1, 2, 3]", False), ("(1, 2)", "[1, 2]", False),
    ("True", "True", True), ("1", "True", False), ("'ab'", "'ab'", True), ('"ab"', "'ab'", True),
    ("ab", "'ab'", False), ("__import__('os')", "0", False),
])
def test_check_is_exact(answer, expected, ok):
    assert check(answer, expected) is ok
    assert check(answer, expected) is ok  # and deterministic


def test_extract_answer_takes_the_first_non_empty_line():
    assert extract_answer("\n  7 \n8") == "7"


def test_multiple_choice_holds_the_right_answer_once_among_distinct_distractors():
    for e in make_split("arithmetic", "heldout", 100, seed=0):
        choices, gold = multiple_choice(e, 4, seed=0)
        assert len(choices) == 4 == len(set(choices))
        assert choices[gold] == e.answer and choices.count(e.answer) == 1
        assert multiple_choice(e, 4, seed=0) == (choices, gold)
    with pytest.raises(ValueError, match="arithmetic"):
        multiple_choice(make_example("python_expr", "1 + 1", "2"))


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="unknown task kind 'algebra'"):
        make_split("algebra", "train", 1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        make_split("arithmetic", "test", 1)


def test_small_arithmetic_is_every_problem_split_by_the_same_hash_rule():
    from stages.evaluate.task_family import small_arithmetic

    held = small_arithmetic("heldout", 9, "+-")
    train = small_arithmetic("train", 9, "+-")
    assert len(held) + len(train) == 2 * 10 * 10 and not {e.question for e in held} & {e.question for e in train}
    for e in held:
        a, op, b = e.question.split()
        assert int(e.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    picked = make_split("arithmetic", "heldout", 10, seed=1, max_operand=9, ops="+-")
    assert picked == make_split("arithmetic", "heldout", 10, seed=1, max_operand=9, ops="+-")
    assert {e.question for e in picked} <= {e.question for e in held}
    with pytest.raises(ValueError, match=f"only {len(held)} heldout arithmetic problems"):
        make_split("arithmetic", "heldout", len(held) + 1, max_operand=9, ops="+-")
