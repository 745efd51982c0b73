"""Faster equivalents of five datatrove internals (same answers), installed so a small corpus is not mostly
overhead: the tiny data stage (imports and run, a fresh process) went from ~6.9 s to ~4.4 s with them.

Fixed costs:
- Every PipelineStep checks its dependencies when it is made or unpickled, and the first check of a
  distribution name reads the metadata of every installed distribution (datatrove's
  `_is_distribution_available`: ~0.25 s a name in this venv, three names per process).
  `importlib.metadata.distribution(name)` finds just the one asked for.
- Every task adds loguru sinks (its log file; the stderr sink datatrove re-adds after each task), and each
  `logger.add` lists the interpreter's library folders anew (`ExceptionFormatter._get_lib_dirs`, ~10 ms:
  0.7 s over the tiny stage's 22 tasks). They are the same for the life of the process; they only decide
  which frames a logged traceback marks as library code.

Hot loops of the Gopher repetition filter (its top 2/3/4-gram shares, a third of the stage's time):
- `get_n_grams` joins each n-gram in a Python loop; `map(" ".join, zip(...))` runs the same joins in C.
- `find_top_duplicate` counts in a Python loop; `Counter(x)` counts in C, in the same insertion order, so
  `most_common(1)` breaks ties the same way.

MinHash:
- `MinhashDedupSignature.get_shingles` hashes each shingle inside a list comprehension; `np.fromiter` over
  `map`s takes the same hashes without the intermediate list and frame.

`install()` is idempotent; the module that defines our pipeline steps calls it, so every process that builds or
unpickles a pipeline (the stage, pool workers, Ray workers, Slurm array tasks) has it before any step is made.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections import Counter

import numpy as np
from datatrove.utils.text import ngrams, simplify_text


@functools.lru_cache
def distribution_available(name: str) -> bool | None:
    """datatrove's answer (True, or None when absent) without reading every distribution's metadata."""
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return True


def get_n_grams(words: list[str], n: int) -> list[str]:
    return list(map(" ".join, zip(*(words[i:] for i in range(n)))))


def find_top_duplicate(x: list[str]) -> int:
    gram, count = Counter(x).most_common(1)[0]
    return len(gram) * count


def get_shingles(self, text: str) -> np.ndarray:
    words = self.word_tokenizer.word_tokenize(simplify_text(text, self.config.norm_config))
    return np.fromiter(map(self._hash_func, map(" ".join, ngrams(words, self.config.n_grams))),
                       dtype=np.uint64).reshape((-1, 1))


def install() -> None:
    from datatrove.pipeline.dedup.minhash import MinhashDedupSignature
    from datatrove.pipeline.filters import gopher_repetition_filter as gopher
    from datatrove.utils import _import_utils
    from loguru._better_exceptions import ExceptionFormatter

    _import_utils._is_distribution_available = distribution_available
    gopher.get_n_grams, gopher.find_top_duplicate = get_n_grams, find_top_duplicate
    MinhashDedupSignature.get_shingles = get_shingles
    if not hasattr(ExceptionFormatter._get_lib_dirs, "cache_info"):
        cached = functools.lru_cache(maxsize=1)(ExceptionFormatter._get_lib_dirs)
        ExceptionFormatter._get_lib_dirs = staticmethod(cached)
