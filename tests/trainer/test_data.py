"""The packed loader: disjoint rank slices, seeded order, exact resume by global sample index."""

import numpy as np
import pytest

from trainer.data import PackedLoader, validation_batches


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    # 50 rows of 9 tokens whose values encode the row: token = row * 9 + position (vocab 512).
    from trainer.shards import PackedShardWriter

    w = PackedShardWriter(root, seq_len=8, vocab_size=512, eos_id=511, rows_per_shard=7)
    w.add(list(range(0, 449)))  # 449 tokens + EOS = 450 = 50 rows of 9, over 8 shards
    w.close()
    return root


def loader(split, **kw):
    args = dict(seq_len=8, global_batch_size=8, micro_batch_size=2, seed=3)
    args.update(kw)
    return PackedLoader(split, **args)


def ids(step):
    return np.concatenate([mb.rows for mb in step])


def test_targets_are_inputs_shifted(split):
    mb = loader(split).next_step()[0]
    assert (mb.inputs[:, 1:] == mb.targets[:, :-1]).all()
    assert mb.inputs.shape == (2, 8)
    assert (mb.inputs[:, 0] == mb.rows.astype(int) * 9).all()


def test_ranks_read_disjoint_slices_that_cover_the_global_batch(split):
    single = loader(split)
    ranks = [loader(split, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(9):  # crosses the 50-row epoch boundary (step 7 holds samples 48..55)
        whole = ids(single.next_step())
        parts = [ids(r.next_step()) for r in ranks]
        assert np.array_equal(np.concatenate(parts), whole)
        assert not set(parts[0]) & set(parts[1]) or len(set(whole)) < len(whole)


def test_each_epoch_is_a_seeded_permutation(split):
    a, b = loader(split), loader(split, seed=4)
    first = np.concatenate([ids(a.next_step()) for _ in range(7)])[:50]
    assert sorted(first) == list(range(50))
    assert not np.array_equal(first, np.concatenate([ids(b.next_step()) for _ in range(7)])[:50])
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert np.array_equal(loader(split).epoch_order(1), a.epoch_order(1))


def test_resume_mid_epoch_at_the_exact_next_row(split):
    a = loader(split)
    for _ in range(3):
        a.next_step()
    state = a.state_dict()
    expected = [ids(a.next_step()) for _ in range(5)]
    b = loader(split)
    b.load_state_dict(state)
    assert [list(x) for x in (ids(b.next_step()) for _ in range(5))] == [list(x) for x in expected]
    # Resharded to 2 ranks: together they read the same rows, none skipped or repeated.
    ranks = [loader(split, dp_rank=r, dp_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    got = np.concatenate([np.concatenate([ids(r.next_step()) for r in ranks]) for _ in range(5)])
    assert np.array_equal(got, np.concatenate(expected))


def test_bad_state_and_shapes_are_refused(split):
    with pytest.raises(ValueError, match="seq_len=8"):
        loader(split, seq_len=16)
    with pytest.raises(ValueError, match="different data"):
        loader(split).load_state_dict({"next_sample": 8, "seed": 99, "rows": 50})
    with pytest.raises(ValueError, match="not divisible"):
        loader(split, global_batch_size=6, micro_batch_size=4)


def test_validation_batches_are_fixed_and_split_between_ranks(split):
    one = validation_batches(split, seq_len=8, batch_size=2, max_batches=3, dp_size=1)
    two = [validation_batches(split, seq_len=8, batch_size=2, max_batches=3, dp_rank=r, dp_size=2) for r in range(2)]
    assert [list(b.rows) for b in one] == [[0, 1], [2, 3], [4, 5]]
    assert sorted(int(x) for part in two for b in part for x in b.rows) == list(range(12))
