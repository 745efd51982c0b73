"""Decontamination: drop training documents that share a word n-gram (13 by default, as GPT-3's and
PaLM's contamination checks did) with any evaluation text; an evaluation text shorter than that but with at
least `min_ngram` words (8, GPT-3's lower bound) must appear whole. Words are lower-cased runs of word characters, so
punctuation, case and whitespace differences do not hide a match.

Evaluation texts come from two places: files named in `data.decontaminate.eval_files`, and providers that
other stages register here (the evaluate stage registers one returning the texts of its benchmark tasks), so
the data stage needs no knowledge of evaluation code:

    from stages.data import register_eval_texts
    register_eval_texts("my-benchmark", lambda cfg: ["question one ...", "question two ..."])
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

from infra.config import LifecycleConfig

from .sources import DataSourceError

_WORD = re.compile(r"\w+")
_PROVIDERS: dict[str, Callable[[LifecycleConfig], list[str]]] = {}


def register_eval_texts(name: str, provider: Callable[[LifecycleConfig], list[str]]) -> None:
    """Register (or replace) a named provider of evaluation texts, called with the lifecycle config."""
    _PROVIDERS[name] = provider


def unregister_eval_texts(name: str) -> None:
    _PROVIDERS.pop(name, None)


def registered_eval_providers() -> list[str]:
    return sorted(_PROVIDERS)


def _read_eval_file(path: Path, text_field: str) -> list[str]:
    if not path.is_file():
        raise DataSourceError(f"data.decontaminate.eval_files: {path} does not exist")
    raw = path.read_bytes()
    try:
        body = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataSourceError(f"data.decontaminate.eval_files: {path} is not UTF-8 (byte {exc.start})") from None
    if path.suffix.lower() in (".json", ".jsonl"):
        texts = []
        for line_no, line in enumerate(body.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataSourceError(f"data.decontaminate.eval_files: {path}:{line_no} is not JSON: {exc}") from None
            if text_field not in row:
                raise DataSourceError(f"data.decontaminate.eval_files: {path}:{line_no} has no field {text_field!r}")
            texts.append(str(row[text_field]))
        return texts
    return [body]


def eval_texts_by_source(cfg: LifecycleConfig) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    dc = cfg.data.decontaminate
    for f in dc.eval_files:
        out[f"file:{f}"] = _read_eval_file(Path(f).expanduser(), dc.text_field)
    for name in sorted(_PROVIDERS):
        out[name] = [str(t) for t in _PROVIDERS[name](cfg)]
    return out


def eval_texts_for_decontamination(cfg: LifecycleConfig) -> list[str]:
    """Every evaluation text the data must not contain: config files first, then registered providers."""
    return [t for texts in eval_texts_by_source(cfg).values() for t in texts]


def eval_texts_digest(cfg: LifecycleConfig) -> str:
    """sha256 over every evaluation text (and its provider's name): put it in the data stage's fingerprint so a
    change in what the evaluate stage registers re-runs decontamination."""
    h = hashlib.sha256()
    for name, texts in sorted(eval_texts_by_source(cfg).items()):
        h.update(name.encode() + b"\x00")
        for t in texts:
            h.update(t.encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()


class ContaminationIndex:
    """The set of evaluation n-grams; `matches(doc)` returns the first shared one, or None.

    An evaluation text with at least n words contributes its n-grams; one with min_n..n-1 words contributes
    itself whole (so short questions are still caught); a shorter one contributes nothing and is counted."""

    def __init__(self, eval_texts: list[str], n: int, min_n: int | None = None):
        self.n = n
        self.min_n = n if min_n is None else min(min_n, n)
        self.grams: set[str] = set()
        self.lengths: set[int] = set()
        self.too_short = 0
        for t in eval_texts:
            words = _WORD.findall(t.casefold())
            if len(words) >= n:
                self.grams |= {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}
                self.lengths.add(n)
            elif len(words) >= self.min_n:
                self.grams.add(" ".join(words))
                self.lengths.add(len(words))
            else:
                self.too_short += 1

    @classmethod
    def from_grams(cls, grams: list[str], lengths: list[int]) -> "ContaminationIndex":
        """An index rebuilt from another's grams and lengths (what a pipeline step carries to its workers)."""
        index = cls([], 1)
        index.grams, index.lengths = set(grams), set(lengths)
        return index

    def __len__(self) -> int:
        return len(self.grams)

    def matches(self, text: str) -> str | None:
        if not self.grams:
            return None
        if not hasattr(self, "_first"):  # first words of the grams: only there can a gram start
            self._first = {g.split(" ", 1)[0] for g in self.grams}
        words = _WORD.findall(text.casefold())
        starts = [i for i, w in enumerate(words) if w in self._first]
        for k in sorted(self.lengths, reverse=True):
            for i in starts:
                if i + k > len(words):
                    break
                g = " ".join(words[i:i + k])
                if g in self.grams:
                    return g
        return None
