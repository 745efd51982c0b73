"""Exact and near dedup through the datatrove pipeline on real standard-library text with planted duplicates in
other shards than their originals, checked against exact Jaccard similarities computed pair by pair."""

import json
import random
import re
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from infra.config import load_config
from infra.config.data import DataConfig, SourceConfig
from infra.workspace import Workspace
from stages.base import StageContext
from stages.data import run_clean
from stages.data.clean import scrub_secrets
from stages.data.dedup import lsh_params, normalized_hash

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Files every cleaning rule keeps (so whatever is dropped below is dropped as a duplicate).
NAMES = ["textwrap.py", "fnmatch.py", "heapq.py", "glob.py", "shlex.py", "string.py", "base64.py", "colorsys.py",
         "copy.py", "netrc.py", "sched.py", "stat.py"]


def mutate(text: str, fraction: float, seed: int) -> str:
    """Replace a fraction of the words with new ones (a lightly edited copy when fraction is small); the lines
    keep their shape, so the copy passes the same quality rules as its original."""
    rng = random.Random(seed)
    words = list(re.finditer(r"\w+", text))
    chosen = set(rng.sample(range(len(words)), int(len(words) * fraction)))
    parts, last = [], 0
    for i, m in enumerate(words):
        if i in chosen:
            parts += [text[last:m.start()], f"e{rng.randrange(10**6)}"]
            last = m.end()
    return "".join(parts) + text[last:]


def shingles(text: str, n: int = 5) -> set[str]:
    words = re.findall(r"\w+", text.casefold())
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b)


def test_exact_hash_ignores_case_and_whitespace_only():
    a = "def f(x):\n    return x\n"
    assert normalized_hash(a) == normalized_hash("DEF  f(x):\n\treturn X  \n")
    assert normalized_hash(a) != normalized_hash(a.replace("x", "y"))


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_lsh_params_match_datasketch(threshold):
    from datasketch.lsh import _optimal_param

    assert lsh_params(threshold, 128) == _optimal_param(threshold, 128, 0.5, 0.5)


def test_duplicates_planted_in_other_shards_are_removed(tmp_path):
    originals = [(STDLIB / n).read_text() for n in NAMES]
    rng = random.Random(0)
    copies, heavy = [], []
    for k, i in enumerate(rng.sample(range(len(originals)), 9)):
        frac = [0.002, 0.004, 0.3][k % 3]  # two light edits (near-duplicates) and one heavy (not one) per three
        (heavy if frac == 0.3 else copies).append(mutate(originals[i], frac, k))
    exact_copy = originals[3].upper()  # case-folded, the same document
    # Three files, three shards (task_mb below a file's size): every copy sits in another shard than its
    # original, after it in corpus order, so the originals are the ones kept.
    d = tmp_path / "in"
    d.mkdir()
    for k, texts in enumerate([originals, copies, heavy + [exact_copy]]):
        (d / f"{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = load_config("tiny")
    cfg.data = DataConfig(sources=[SourceConfig(name="code", path=str(d))], workers=1, task_mb=0.001)
    cfg.infra.workdir = str(tmp_path / "ws")
    summary = run_clean(StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out"))
    assert summary["tasks"] == 3

    card = json.loads((tmp_path / "out" / "data_card.json").read_text())
    drops = {(r["step"], r["reason"]): r["documents"] for r in card["drops"]}
    kept = {t for split in ("train", "validation") for f in (tmp_path / "out" / split).glob("*.parquet")
            for t in pq.read_table(f).column("text").to_pylist()}
    # Reference: exact Jaccard of every copy with its closest original. At J >= 0.95 the 9 bands of 13 rows
    # (threshold 0.8, 128 permutations) find a pair with probability 0.998; heavy edits sit far below.
    sim = [max(jaccard(shingles(c), shingles(o)) for o in originals) for c in copies + heavy]
    assert min(sim[:len(copies)]) >= 0.95 and max(sim[len(copies):]) < 0.5  # the planted copies are what they claim
    assert drops.get(("exact_dedup", "exact_duplicate")) == 1
    assert drops.get(("near_dedup", "near_duplicate")) == len(copies)
    assert kept == {scrub_secrets(t)[0] for t in originals + heavy}
