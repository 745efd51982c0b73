"""The loader with a data mixture: each source's share of samples follows its weight (chunk by chunk),
rows come from the right source's range without repeats within that source's epoch, and the stream
resumes and reshards exactly like the unweighted one."""

import json
from collections import Counter

import numpy as np
import pytest

from stages.data.pack import record_sources, source_row_ranges
from trainer.data import MixtureOrder, PackedLoader
from trainer.shards import PackedShardWriter

SEQ = 8
# Three sources laid out one after the other, as the tokens stage writes them: rows of 9 tokens.
SOURCES = [("a", 60), ("b", 30), ("c", 10)]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixsplit")
    w = PackedShardWriter(root, seq_len=SEQ, vocab_size=4096, eos_id=4095, rows_per_shard=7)
    spans, row = [], 0
    for name, rows in SOURCES:
        # One document per source filling exactly `rows` rows; token = global row * 9 + position.
        ids = np.arange(row * (SEQ + 1), (row + rows) * (SEQ + 1) - 1)
        w.add(ids)
        spans.append((name, ids.size + 1))
        row += rows
    record_sources(root, w.close(), spans)
    return root


def loader(split, **kw):
    args = dict(seq_len=SEQ, global_batch_size=16, micro_batch_size=4, seed=5, mixture={"a": 1.0, "b": 1.0, "c": 2.0})
    args.update(kw)
    return PackedLoader(split, **args)


def ids(step):
    return np.concatenate([mb.rows for mb in step])


def source_of_row(r):
    return "a" if r < 60 else "b" if r < 90 else "c"


def test_row_ranges_round_at_boundaries_and_tile_the_split(split):
    index = json.loads((split / "index.json").read_text())
    assert index["sources"] == [{"name": "a", "start": 0, "end": 60}, {"name": "b", "start": 60, "end": 90},
                                {"name": "c", "start": 90, "end": 100}]
    # A boundary inside a row goes to the source holding most of it; the dropped tail shortens the last.
    assert source_row_ranges([("x", 104), ("y", 52), ("z", 9)], rows=16, row_len=10) == [
        {"name": "x", "start": 0, "end": 10}, {"name": "y", "start": 10, "end": 16}, {"name": "z", "start": 16, "end": 16}]


def test_shares_follow_the_weights_chunk_by_chunk(split):
    order = MixtureOrder({"a": (0, 60), "b": (60, 90), "c": (90, 100)}, {"a": 1.0, "b": 1.0, "c": 2.0}, seed=5)
    B = order.chunk
    for c in range(3):
        counts = Counter(order.source_of(g) for g in range(c * B, (c + 1) * B))
        for name, share in (("a", 0.25), ("b", 0.25), ("c", 0.5)):
            assert abs(counts[name] - share * B) <= 1, (c, counts)
    # Through the loader: the rows drawn lie in their source's range, shares within 1% over 2000 samples.
    ld = loader(split)
    rows = np.concatenate([ids(ld.next_step()) for _ in range(125)])
    got = Counter(source_of_row(int(r)) for r in rows)
    assert abs(got["a"] / 2000 - 0.25) < 0.01 and abs(got["c"] / 2000 - 0.5) < 0.01, got
    # c has 10 rows: its first 10 samples are a permutation of them, the next 10 another one.
    c_rows = [int(r) for r in rows if r >= 90]
    assert sorted(c_rows[:10]) == list(range(90, 100)) and sorted(c_rows[10:20]) == list(range(90, 100))
    assert c_rows[:10] != c_rows[10:20]
    # A zero weight leaves the source out entirely.
    no_b = loader(split, mixture={"a": 1.0, "b": 0.0, "c": 1.0})
    assert not any(60 <= r < 90 for _ in range(20) for r in ids(no_b.next_step()))


def test_mixture_resumes_and_reshards_exactly(split):
    a = loader(split)
    for _ in range(70):  # past the first chunk (1024 samples = 64 steps)
        a.next_step()
    state = a.state_dict()
    expected = [ids(a.next_step()) for _ in range(4)]
    b = loader(split)
    b.load_state_dict(state)
    assert [list(x) for x in (ids(b.next_step()) for _ in range(4))] == [list(x) for x in expected]
    ranks = [loader(split, dp_rank=r, dp_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    got = np.concatenate([np.concatenate([ids(r.next_step()) for r in ranks]) for _ in range(4)])
    assert np.array_equal(got, np.concatenate(expected))
    # The seed changes the order, not the shares.
    other = loader(split, seed=6)
    assert not np.array_equal(ids(other.next_step()), ids(loader(split).next_step()))


def test_mismatches_are_refused(split, tmp_path):
    state = loader(split).state_dict()
    with pytest.raises(ValueError, match="data mixture"):
        loader(split, mixture=None).load_state_dict(state)
    with pytest.raises(ValueError, match="data mixture"):
        loader(split, mixture={"a": 1.0, "b": 1.0, "c": 1.0}).load_state_dict(state)
    loader(split, mixture={"a": 2.0, "b": 2.0, "c": 4.0}).load_state_dict(state)  # same shares
    with pytest.raises(ValueError, match=r"\['zz'\]"):
        loader(split, mixture={"a": 1.0, "zz": 1.0})
    with pytest.raises(ValueError, match="weight 0"):
        loader(split, mixture={"a": 0.0})
    with pytest.raises(ValueError, match=">= 0"):
        loader(split, mixture={"a": -1.0, "b": 2.0})
    # A split packed before sources were recorded: uniform rows still work, a mixture is a clear error.
    w = PackedShardWriter(tmp_path, seq_len=SEQ, vocab_size=512, eos_id=511, rows_per_shard=8)
    w.add(list(range(80)))
    w.close()
    assert len(ids(PackedLoader(tmp_path, seq_len=SEQ, global_batch_size=4, micro_batch_size=4).next_step())) == 4
    with pytest.raises(ValueError, match="re-run the tokens stage"):
        PackedLoader(tmp_path, seq_len=SEQ, global_batch_size=4, micro_batch_size=4, mixture={"a": 1.0})
