"""The serve stage's engine-vs-transformers check accepts two fp32 implementations parting on a near-tie
of transformers' own logits (a coin flip of float rounding, machine to machine), and nothing else."""

from types import SimpleNamespace

import torch

from stages.serve.stage import divergence_is_a_tie


class FixedLogits:
    """Stands in for a transformers model: the same last-position logits whatever the input."""

    def __init__(self, last):
        self.last = torch.tensor(last)
        self.seen = []

    def __call__(self, ids):
        self.seen.append(ids[0].tolist())
        return SimpleNamespace(logits=self.last.expand(1, ids.shape[1], -1))


def test_identical_outputs_are_no_tie():
    assert divergence_is_a_tie(FixedLogits([0.0, 1.0]), [5], [1, 1], [1, 1]) is None


def test_parting_on_a_near_tie_is_accepted_at_the_first_difference():
    hf = FixedLogits([10.0, 10.0 - 1e-6, -3.0])
    tie = divergence_is_a_tie(hf, [7, 8], [2, 1, 0], [2, 0, 1])
    assert tie is not None and tie["position"] == 1 and 0 <= tie["relative_gap"] < 1e-6
    assert hf.seen == [[7, 8, 2]]  # transformers' logits on its own prefix up to the parting


def test_parting_on_a_clear_choice_is_a_disagreement():
    assert divergence_is_a_tie(FixedLogits([10.0, 9.0, -3.0]), [7], [1], [0]) is None
