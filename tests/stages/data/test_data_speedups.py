"""stages/data/speedups.py replaces datatrove internals with faster code: each must give datatrove's own answer."""

import random
from pathlib import Path

import numpy as np
import pytest
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
from datatrove.pipeline.filters import gopher_repetition_filter as gopher
from datatrove.utils import _import_utils

from stages.data import speedups
from stages.data.dedup import xxh64_text
from stages.data.steps import WORDS

STDLIB = Path(random.__file__).parent


def words_of(text: str) -> list[str]:
    return text.split()


@pytest.fixture(scope="module")
def originals():
    """datatrove's functions as its modules define them (speedups.install() has replaced them by now)."""
    import importlib.util

    spec = importlib.util.find_spec("datatrove.pipeline.filters.gopher_repetition_filter")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return fresh


@pytest.mark.parametrize("name", ["textwrap.py", "heapq.py", "shlex.py"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 9])
def test_gopher_n_grams_and_top_duplicate_equal_datatrove(originals, name, n):
    words = words_of((STDLIB / name).read_text())
    assert speedups.get_n_grams(words, n) == originals.get_n_grams(words, n)
    grams = originals.get_n_grams(words, n)
    assert speedups.find_top_duplicate(grams) == originals.find_top_duplicate(grams)


def test_top_duplicate_breaks_ties_as_datatrove(originals):
    rng = random.Random(0)
    for _ in range(200):
        # few distinct grams of different lengths, so counts tie often and the first one seen must win
        grams = [rng.choice(["a", "bb", "ccc", "dddd"]) for _ in range(rng.randint(1, 8))]
        assert speedups.find_top_duplicate(grams) == originals.find_top_duplicate(grams)
    assert speedups.get_n_grams(["x"], 2) == originals.get_n_grams(["x"], 2) == []


def test_installed_where_datatrove_looks_them_up():
    import stages.data.steps  # noqa: F401  (installs)

    assert gopher.get_n_grams is speedups.get_n_grams and gopher.find_top_duplicate is speedups.find_top_duplicate
    assert _import_utils._is_distribution_available is speedups.distribution_available
    assert MinhashDedupSignature.get_shingles is speedups.get_shingles


@pytest.mark.parametrize("name", ["pyarrow", "xxhash", "numpy", "no-such-distribution-eightfold"])
def test_distribution_check_equals_datatrove_scan(name):
    import importlib.metadata

    scanned = None  # datatrove's own rule: some installed distribution's Name, lowercased, equals the name
    for dist in importlib.metadata.distributions():
        if (dist.metadata.get("Name") or "").lower() == name:
            scanned = True
    assert speedups.distribution_available(name) == scanned


def test_shingles_equal_datatrove_list_comprehension(tmp_path):
    from datatrove.utils.text import ngrams, simplify_text

    sig = MinhashDedupSignature(str(tmp_path), MinhashConfig(), language=WORDS)  # the stage's word splitter
    sig._hash_func = xxh64_text
    text = (STDLIB / "textwrap.py").read_text()
    words = sig.word_tokenizer.word_tokenize(simplify_text(text, sig.config.norm_config))
    expected = np.fromiter([xxh64_text(" ".join(x)) for x in ngrams(words, sig.config.n_grams)], dtype=np.uint64)
    got = sig.get_shingles(text)
    assert got.shape == (len(expected), 1) and np.array_equal(got[:, 0], expected)
