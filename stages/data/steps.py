"""The data stage's own datatrove pipeline steps: what datatrove has no step for (reading our sources, the
code rules, secrets scrubbing, 13-gram decontamination, the train/validation tag), and the accounting that
the data card is built from.

Every step counts, per source, the documents and bytes that came in, went out and were dropped for each
reason, in datatrove's own stats (`stat_update`), so the executor writes them with each task's stats file
(`{logging_dir}/stats/{rank}.json`) under every executor alike. A few example origins per drop reason go to
`{logging_dir}/examples/{step}/{rank}.json` (stats hold numbers only). datatrove's filters are wrapped in
`Measured`, which takes the same counts around them: their drop reasons come through the exclusion writer
that datatrove filters call for every document they drop.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from datatrove.data import Document, DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.word_tokenizers import WordTokenizer

from infra.config.data import CleanConfig

from . import speedups
from .clean import normalize, quality_reason, scrub_secrets
from .dedup import normalized_hash
from .split import hash_fraction

speedups.install()

SEP = "|"  # stat labels: "<kind>|<source>[|<reason>]"; source names are config labels without "|"
EXAMPLES_PER_REASON = 5


def nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


class RegexWords(WordTokenizer):
    """Words as runs of word characters (what the old rules and shingles used). datatrove's English tokenizer
    is spaCy's, whose model would be a download; this one needs nothing and treats code and prose alike."""

    _WORD = re.compile(r"\w+")
    _SENT = re.compile(r"[^.!?\n]+[.!?]*")

    def __init__(self):
        super().__init__("en")

    def word_tokenize(self, text: str) -> list[str]:
        return self._WORD.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [text[a:b] for a, b in self.span_tokenize(text)]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in self._SENT.finditer(text) if m.group().strip()]


WORDS = RegexWords()


class Accounting(PipelineStep):
    """Per-source counts in this step's stats, plus a few example origins per drop reason."""

    type = "🧮 - EIGHTFOLD"

    def __init__(self, name: str, logging_dir: str):
        self.name = name  # before PipelineStep.__init__, which names the stats after it
        super().__init__()
        self.logging_dir = logging_dir
        self._examples: dict[str, list[str]] = {}

    def note_in(self, doc: Document) -> None:
        self.stat_update(f"in{SEP}{doc.metadata['source']}")
        self.stat_update(f"in_bytes{SEP}{doc.metadata['source']}", value=nbytes(doc.text))

    def note_out(self, doc: Document) -> None:
        self.stat_update(f"out{SEP}{doc.metadata['source']}")
        self.stat_update(f"out_bytes{SEP}{doc.metadata['source']}", value=nbytes(doc.text))

    def note_drop(self, source: str, reason: str, origin: str, size: int) -> None:
        self.stat_update(f"drop{SEP}{source}{SEP}{reason}")
        self.stat_update(f"drop_bytes{SEP}{source}{SEP}{reason}", value=size)
        ex = self._examples.setdefault(reason, [])
        if len(ex) < EXAMPLES_PER_REASON:
            ex.append(origin)

    def save_examples(self, rank: int) -> None:
        if self._examples:
            folder = get_datafolder(self.logging_dir)
            with folder.open(f"examples/{self.name}/{rank:05d}.json", "w") as f:
                json.dump(self._examples, f)


class DocStep(Accounting):
    """A step that maps each document to itself, a changed copy, or a drop with a reason: `process(doc)`."""

    def process(self, doc: Document) -> tuple[Document | None, str]:
        raise NotImplementedError

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            self.note_in(doc)
            with self.track_time():
                new, reason = self.process(doc)
            if new is None:
                self.note_drop(doc.metadata["source"], reason, doc.metadata["origin"], nbytes(doc.text))
                continue
            self.note_out(new)
            yield new
        self.save_examples(rank)


class ReadPlanned(Accounting):
    """Reader: the rank's share of the sources (`plan/{rank}.json`, written by the stage before it starts).
    Unreadable files are counted drops of this step, never skipped silently."""

    type = "📖 - READER"

    def __init__(self, sources: list[dict], plan_folder: str, max_doc_bytes: int, cache_dir: str | None,
                 logging_dir: str):
        super().__init__("read", logging_dir)
        self.sources = sources  # SourceConfig dumps: a plain dict pickles under every executor
        self.plan_folder = plan_folder
        self.max_doc_bytes = max_doc_bytes
        self.cache_dir = cache_dir

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from infra.config.data import SourceConfig

        from .sources import SourceReader

        with get_datafolder(self.plan_folder).open(f"{rank:05d}.json", "r") as f:
            units = json.load(f)
        by_name = {s["name"]: SourceConfig(**s) for s in self.sources}
        for unit in units:
            src = by_name[unit["source"]]
            reader = SourceReader(src, self.max_doc_bytes, self.cache_dir, files=unit["files"])
            for d in reader:
                doc = Document(text=d.text, id=d.origin, metadata={"source": d.source, "origin": d.origin})
                self.note_in(doc)
                self.note_out(doc)
                yield doc
            st = reader.stats
            for reason, count in st.drops.items():
                self.stat_update(f"in{SEP}{src.name}", value=count)
                self.stat_update(f"in_bytes{SEP}{src.name}", value=st.drop_bytes[reason])
                self.stat_update(f"drop{SEP}{src.name}{SEP}{reason}", value=count)
                self.stat_update(f"drop_bytes{SEP}{src.name}{SEP}{reason}", value=st.drop_bytes[reason])
                ex = self._examples.setdefault(reason, [])
                ex.extend(st.examples.get(reason, [])[: EXAMPLES_PER_REASON - len(ex)])
        self.save_examples(rank)


class Normalize(DocStep):
    def __init__(self, form: str, logging_dir: str):
        super().__init__("normalize", logging_dir)
        self.form = form

    def process(self, doc):
        doc.text = normalize(doc.text, self.form)
        return doc, ""


class CodeRules(DocStep):
    """Length limits and StarCoder's code rules, plus the character-ratio rules datatrove has no filter for
    (clean.py: quality_reason)."""

    def __init__(self, clean: dict, logging_dir: str):
        super().__init__("quality", logging_dir)
        self.clean = clean

    def process(self, doc):
        if not hasattr(self, "_cfg"):
            self._cfg = CleanConfig(**self.clean)
        reason = quality_reason(doc.text, self._cfg)
        return (None, reason) if reason else (doc, "")


class ScrubSecrets(DocStep):
    def __init__(self, logging_dir: str):
        super().__init__("scrub_secrets", logging_dir)

    def process(self, doc):
        doc.text, found = scrub_secrets(doc.text)
        for kind, n in found.items():
            self.stat_update(f"secret{SEP}{kind}", value=n)
        return doc, ""


class Decontaminate(DocStep):
    """Drop documents sharing an n-gram with an evaluation text (decontaminate.py: ContaminationIndex)."""

    def __init__(self, grams: list[str], lengths: list[int], logging_dir: str):
        super().__init__("decontaminate", logging_dir)
        self.grams, self.lengths = grams, lengths

    def process(self, doc):
        from .decontaminate import ContaminationIndex

        if not hasattr(self, "_index"):
            self._index = ContaminationIndex.from_grams(self.grams, self.lengths)
        if self._index.matches(doc.text) is not None:
            return None, "eval_ngram_overlap"
        return doc, ""


class AssignId(PipelineStep):
    """The document's id becomes its content hash (dedup.normalized_hash): the split and the cleaned files' id."""

    type = "🧮 - EIGHTFOLD"
    name = "assign_id"

    def run(self, data, rank=0, world_size=1):
        for doc in data:
            doc.id = normalized_hash(doc.text)
            yield doc


class _DropTap:
    """What a datatrove filter takes as its exclusion writer: it is handed every dropped document, which is
    how the drop reasons of datatrove's filters reach our accounting."""

    def __init__(self, owner: "Measured"):
        self.owner = owner

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __bool__(self):
        return True

    def write(self, doc: Document, rank: int = 0) -> None:
        reason = doc.metadata.pop("filter_reason", None) or self.owner.reason_for(doc)
        self.owner.note_drop(doc.metadata["source"], reason, doc.metadata["origin"], nbytes(doc.text))


class Measured(Accounting):
    """A datatrove filter, counted like our own steps. `position` tags each document with its index in the
    task's stream (what datatrove's dedup filters key on) for `reason_for`."""

    def __init__(self, inner: PipelineStep, name: str, logging_dir: str, default_reason: str = "dropped"):
        super().__init__(name, logging_dir)
        self.inner = inner
        self.default_reason = default_reason

    def reason_for(self, doc: Document) -> str:
        return self.default_reason

    def run(self, data, rank=0, world_size=1):
        self.inner.exclusion_writer = _DropTap(self)
        self.prepare(rank)

        def feed():
            for i, doc in enumerate(data):
                doc.metadata["_position"] = i
                self.note_in(doc)
                yield doc

        for doc in self.inner.run(feed(), rank, world_size):
            doc.metadata.pop("_position", None)
            self.note_out(doc)
            yield doc
        self.save_examples(rank)

    def prepare(self, rank: int) -> None:
        pass


class DedupFilter(Measured):
    """datatrove's MinhashDedupFilter over the cluster stage's `.remove` files (which hold exact duplicates
    too); a dropped document listed in the rank's `.exact` file is an exact duplicate, any other a near one."""

    def __init__(self, inner: PipelineStep, remove_folder: str, logging_dir: str):
        super().__init__(inner, "dedup", logging_dir, "near_duplicate")
        self.remove_folder = remove_folder

    def prepare(self, rank):
        import numpy as np

        folder = get_datafolder(self.remove_folder)
        name = f"{rank:06d}.exact"
        self._exact = set()
        if folder.isfile(name):
            with folder.open(name, "rb") as f:
                self._exact = set(np.frombuffer(f.read(), dtype="<u4").tolist())

    def reason_for(self, doc):
        return "exact_duplicate" if doc.metadata.get("_position") in self._exact else "near_duplicate"


class RunAll(PipelineStep):
    """Runs steps that take no input one after the other, each to its end (datatrove chains generators lazily,
    so a step after one that ignores its input would otherwise never run)."""

    type = "🧮 - EIGHTFOLD"
    name = "run_all"

    def __init__(self, steps: list[PipelineStep]):
        super().__init__()
        self.steps = steps

    def run(self, data=None, rank=0, world_size=1):
        from collections import deque

        for step in self.steps:
            out = step.run(None, rank, world_size)
            if out is not None:
                deque(out, maxlen=0)
        return
        yield


class Signatures(PipelineStep):
    """The last step of the filtering pass: datatrove's MinHash signatures (MinhashDedupSignature) and exact
    signatures (ExactDedupSignature) of the same documents in one go, in the order they were written."""

    type = "🫂 - DEDUP"
    name = "signatures"

    def __init__(self, minhash: PipelineStep | None, exact: PipelineStep | None):
        super().__init__()
        self.minhash, self.exact = minhash, exact

    def run(self, data, rank=0, world_size=1):
        from collections import deque

        exact: list = []

        def tap():
            for i, doc in enumerate(data):
                doc.metadata["shard"] = rank  # dedup.shard_priority
                if self.exact is not None:
                    exact.extend(self.exact.get_hashes(doc, i))
                yield doc

        if self.minhash is not None:
            self.minhash.run(tap(), rank, world_size)
        else:
            deque(tap(), maxlen=0)
        if self.exact is not None:
            self.exact.save_hashes(rank, exact)
        return
        yield


class ShardReader(PipelineStep):
    """Reads back the filtering pass's shard of this rank (`{rank}.jsonl`), in written order; none: no documents."""

    type = "📖 - READER"
    name = "filtered_shard"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data=None, rank=0, world_size=1):
        folder = get_datafolder(self.folder)
        name = f"{rank:05d}.jsonl"
        if not folder.isfile(name):
            return
        with folder.open(name, "r") as f:
            for line in f:
                row = json.loads(line)
                yield Document(text=row["text"], id=row["id"], metadata={"source": row["source"], "origin": row["origin"]})


class SplitTag(Accounting):
    """Tags each document `train` or `validation` by its hash (split.hash_fraction) and remembers, per source,
    what the stage needs to correct the split of a tiny corpus (split.assign_validation's two rules) without
    another pass: counts, the highest-fraction validation document and the lowest-fraction document."""

    def __init__(self, val_fraction: float, logging_dir: str):
        super().__init__("split", logging_dir)
        self.val_fraction = val_fraction

    def run(self, data, rank=0, world_size=1):
        extremes: dict[str, dict[str, Any]] = {}
        for doc in data:
            src = doc.metadata["source"]
            frac = hash_fraction(doc.id)
            split = "validation" if frac < self.val_fraction else "train"
            doc.metadata["split"] = split
            self.stat_update(f"{split}{SEP}{src}")
            self.stat_update(f"{split}_bytes{SEP}{src}", value=nbytes(doc.text))
            e = extremes.setdefault(src, {"max_val": None, "min_all": None})
            if split == "validation" and (e["max_val"] is None or frac > e["max_val"][0]):
                e["max_val"] = (frac, doc.id, rank)
            if e["min_all"] is None or frac < e["min_all"][0]:
                e["min_all"] = (frac, doc.id, rank)
            yield doc
        if extremes:
            with get_datafolder(self.logging_dir).open(f"split/{rank:05d}.json", "w") as f:
                json.dump(extremes, f)


def output_row(self, doc: Document) -> dict:
    """ParquetWriter adapter: the cleaned-data contract's columns (pipeline.COLUMNS)."""
    return {"id": doc.id, "source": doc.metadata["source"], "origin": doc.metadata["origin"], "text": doc.text}


def merged_counts(stats: list[dict]) -> Counter:
    """Sum of one step's stat totals over its tasks."""
    out: Counter = Counter()
    for st in stats:
        for label, m in st.items():
            out[label] += m["total"] if isinstance(m, dict) else m
    return out
