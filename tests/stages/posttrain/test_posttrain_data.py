"""The built-in post-training data comes from the task family's train split only, deterministically;
the held-out set never shares a problem with it; DPO's rejected answers are always wrong."""

from infra.config.posttrain import TaskConfig
from stages.evaluate.task_family import check, split_of
from stages.posttrain.data import builtin_rows, heldout


def _question(row):
    return row["messages"][0]["content"].removeprefix("Q: What is ").removesuffix("?\nA:")


def test_builtin_rows_are_train_split_and_deterministic():
    task = TaskConfig(max_operand=12, ops="+-")
    held = {e.question for e in heldout(task)}
    for step in ("sft", "dpo", "grpo"):
        rows = builtin_rows(step, task, 300, seed=3)
        assert rows == builtin_rows(step, task, 300, seed=3)
        assert rows != builtin_rows(step, task, 300, seed=4)
        qs = {_question(r) for r in rows}
        assert all(split_of("arithmetic", q) == "train" for q in qs)
        assert not qs & held
    for r in builtin_rows("dpo", task, 200, seed=0):
        a, op, b = _question(r).split()
        right = str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert check(r["chosen"], right) and not check(r["rejected"], right)
    sft = builtin_rows("sft", task, 5, seed=0)[0]["messages"]
    assert [m["role"] for m in sft] == ["user", "assistant"]


def test_heldout_is_fixed_and_capped():
    task = TaskConfig(max_operand=30, heldout_size=50)
    h = heldout(task, seed=0)
    assert len(h) == 50 and h == heldout(task, seed=0)
    assert all(split_of("arithmetic", e.question) == "heldout" for e in h)
