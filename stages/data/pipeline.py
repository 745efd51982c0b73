"""`run_clean`: sources -> cleaned, deduplicated, decontaminated documents split into train/ and validation
parquet shards, with a data card that accounts for every document and byte dropped on the way.

Steps, in order: read (unreadable/non-UTF-8/empty/oversized files are counted drops), normalise, quality
rules, secrets scrubbing, exact dedup, near dedup, decontamination, split. Mixture weights are not applied
here: every kept document is written once, and `run_pack` samples documents so that each source's share of
training tokens follows its weight (tokens are only known after the tokenizer exists).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infra.config.data import DataConfig
from infra.progress import progress_bar

from ..base import StageContext
from .card import DataCard, quiet_datasets
from .clean import normalize, quality_reason, scrub_secrets
from .decontaminate import ContaminationIndex, eval_texts_by_source
from .dedup import MinHasher, near_duplicates, normalized_hash, shingle_hashes
from .sources import DataSourceError, SourceReader, validate_source
from .split import assign_validation

COLUMNS = ("id", "source", "origin", "text")
SIGNATURE_SLICE = 1024  # documents per MinHash call: the near-dedup bar moves once per slice


@dataclass
class Kept:
    source: str
    origin: str
    text: str
    id: str = ""

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8", "surrogatepass"))


@dataclass
class StepLog:
    """Documents and bytes in and out of one step, with drops per reason (and per source)."""

    name: str
    docs_in: int = 0
    bytes_in: int = 0
    docs_out: int = 0
    bytes_out: int = 0
    drops: Counter = field(default_factory=Counter)
    per_source_out: Counter = field(default_factory=Counter)
    source_drops: Counter = field(default_factory=Counter)  # (source, reason) -> documents
    examples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, reason: str, origin: str, source: str = "") -> None:
        self.drops[reason] += 1
        self.source_drops[(source, reason)] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 5:
            ex.append(origin)

    def row(self) -> dict[str, Any]:
        return {
            "step": self.name, "docs_in": self.docs_in, "bytes_in": self.bytes_in, "docs_out": self.docs_out,
            "bytes_out": self.bytes_out, "dropped": self.docs_in - self.docs_out,
            "drops": ", ".join(f"{k}={v}" for k, v in sorted(self.drops.items())) or "-",
        }


def _run_step(name: str, docs: list[Kept], fn, progress: bool = True) -> tuple[list[Kept], StepLog]:
    """Apply fn(doc) -> (doc or None, drop reason) to every document and log what it did; a progress
    bar named after the step counts documents (`progress=False` for a step too cheap to show)."""
    log = StepLog(name, docs_in=len(docs), bytes_in=sum(d.nbytes for d in docs))
    out = []
    with progress_bar(len(docs), f"data {name}", "doc", enabled=progress) as bar:
        for d in docs:
            new, reason = fn(d)
            if new is None:
                log.note(reason, d.origin, d.source)
            else:
                out.append(new)
                log.per_source_out[new.source] += 1
            bar.update()
    log.docs_out, log.bytes_out = len(out), sum(d.nbytes for d in out)
    return out, log


def validate_data_config(cfg: DataConfig) -> None:
    for src in cfg.sources:
        validate_source(src)


def read_sources(cfg: DataConfig, cache_dir: Path | None = None) -> tuple[list[Kept], StepLog, dict[str, dict]]:
    """Read every source; a source with no readable document is an error naming it and what was dropped."""
    docs: list[Kept] = []
    log = StepLog("read")
    per_source: dict[str, dict] = {}
    # A document longer than max_chars is dropped anyway; files beyond 4 bytes/char of that are not even read.
    max_doc_bytes = 4 * cfg.clean.max_chars
    for src in cfg.sources:
        reader = SourceReader(src, max_doc_bytes, cache_dir)
        for doc in reader:
            docs.append(Kept(doc.source, doc.origin, doc.text))
        st = reader.stats
        per_source[src.name] = {"documents_read": st.documents, "bytes_read": st.bytes, "unreadable": dict(st.drops),
                                "weight": src.weight, "kind": src.kind}
        log.docs_in += st.documents + sum(st.drops.values())
        log.bytes_in += st.bytes + sum(st.drop_bytes.values())
        log.drops.update(st.drops)
        for reason, ex in st.examples.items():
            log.examples.setdefault(reason, []).extend(ex[: 5 - len(log.examples.get(reason, []))])
        log.per_source_out[src.name] = st.documents
        if st.documents == 0:
            what = f"; dropped while reading: {dict(st.drops)} e.g. {st.examples}" if st.drops else ""
            raise DataSourceError(f"source {src.name!r} yielded no documents{what}")
    log.docs_out, log.bytes_out = len(docs), sum(d.nbytes for d in docs)
    return docs, log, per_source


def _write_split(docs: list[Kept], out: Path, shard_bytes: int) -> list[str]:
    """Parquet shards of about shard_bytes of text each, written with pyarrow (what datasets' to_parquet
    calls underneath): a datasets.Dataset built only to be written would be fingerprinted, and hashing its
    table through dill disassembles bytecode to stdout, which Prefect's log_prints turns into log lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if out.exists():  # leftovers of an interrupted attempt must not join this split
        shutil.rmtree(out)
    out.mkdir(parents=True)
    files, start, size = [], 0, 0
    bounds = []
    for i, d in enumerate(docs):
        size += d.nbytes
        if size >= shard_bytes:
            bounds.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(docs) or not bounds:
        bounds.append((start, len(docs)))
    for k, (a, b) in enumerate(bounds):
        part = docs[a:b]
        table = pa.table({c: pa.array([getattr(d, c) for d in part], type=pa.string()) for c in COLUMNS})
        name = f"part-{k:05d}.parquet"
        pq.write_table(table, str(out / name))
        files.append(name)
    return files


def run_clean(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.cfg.data
    t0 = time.perf_counter()
    # Validate before work: every source resolvable, every evaluation file readable.
    validate_data_config(cfg)
    eval_sets = eval_texts_by_source(ctx.cfg)
    contamination = ContaminationIndex([t for ts in eval_sets.values() for t in ts], cfg.decontaminate.ngram,
                                       cfg.decontaminate.min_ngram)
    ctx.log_params({"data.sources": ",".join(f"{s.name}:{s.kind}:{s.weight}" for s in cfg.sources),
                    "data.dedup.threshold": cfg.dedup.threshold, "data.decontaminate.ngram": cfg.decontaminate.ngram,
                    "data.normalization": cfg.clean.normalization, "data.val_fraction": cfg.val_fraction})

    docs, read_log, per_source = read_sources(cfg, ctx.workspace.path("scratch", "datasets-cache"))
    steps = [read_log]

    cc = cfg.clean
    docs, log = _run_step("normalize", docs, lambda d: (Kept(d.source, d.origin, normalize(d.text, cc.normalization)), ""))
    steps.append(log)

    def quality(d: Kept):
        reason = quality_reason(d.text, cc)
        return (None, reason) if reason else (d, "")

    docs, log = _run_step("quality", docs, quality)
    steps.append(log)

    secrets: Counter = Counter()
    if cc.scrub_secrets:
        def scrub(d: Kept):
            text, found = scrub_secrets(d.text)
            secrets.update(found)
            return Kept(d.source, d.origin, text), ""

        docs, log = _run_step("scrub_secrets", docs, scrub)
        steps.append(log)

    for d in docs:
        d.id = normalized_hash(d.text)
    if cfg.dedup.exact:
        seen: set[str] = set()

        def exact(d: Kept):
            if d.id in seen:
                return None, "exact_duplicate"
            seen.add(d.id)
            return d, ""

        docs, log = _run_step("exact_dedup", docs, exact)
        steps.append(log)

    near_info: dict[str, Any] = {}
    if cfg.dedup.near and docs:
        t = time.perf_counter()
        hasher = MinHasher(cfg.dedup.num_perm)
        # Two passes, each with its bar: MinHash signatures (a document's signature depends on it alone,
        # so they are computed a slice at a time and the bar moves per slice), then LSH bucketing.
        with progress_bar(len(docs), "data near_dedup minhash", "doc") as bar:
            parts = []
            for k in range(0, len(docs), SIGNATURE_SLICE):
                part = docs[k:k + SIGNATURE_SLICE]
                parts.append(hasher.signatures([shingle_hashes(d.text, cfg.dedup.shingle) for d in part]))
                bar.update(len(part))
            sigs = np.concatenate(parts)
        with progress_bar(len(docs), "data near_dedup lsh", "doc") as bar:
            res = near_duplicates(sigs, cfg.dedup.threshold, advance=bar.update)
        keep = {i for i in range(len(docs)) if res.keep[i]}
        index = {id(d): i for i, d in enumerate(docs)}
        docs, log = _run_step("near_dedup", docs, lambda d: (d, "") if index[id(d)] in keep else (None, "near_duplicate"),
                              progress=False)
        steps.append(log)
        near_info = {"bands": res.bands, "rows": res.rows, "candidate_pairs": res.candidate_pairs,
                     "seconds": round(time.perf_counter() - t, 3)}

    contaminated: Counter = Counter()
    if len(contamination):
        def decontaminate(d: Kept):
            gram = contamination.matches(d.text)
            if gram is not None:
                contaminated[gram] += 1
                return None, "eval_ngram_overlap"
            return d, ""

        docs, log = _run_step("decontaminate", docs, decontaminate)
        steps.append(log)

    kept_per_source = Counter(d.source for d in docs)
    empty = [s.name for s in cfg.sources if kept_per_source[s.name] == 0]
    if empty:
        lost = {name: {f"{st.name}/{r}": c for st in steps for (s, r), c in st.source_drops.items() if s == name}
                for name in empty}
        raise DataSourceError(
            f"source(s) {empty} yielded zero documents after filtering (drops: {lost}); loosen data.clean or remove the source"
        )
    if len(docs) < 2:
        raise DataSourceError(f"only {len(docs)} document(s) left after filtering: need at least 2 for a train/validation split")

    is_val = assign_validation([d.id for d in docs], cfg.val_fraction, [d.source for d in docs])
    if not is_val.any():
        raise DataSourceError(
            f"no validation document: {len(docs)} documents left, none of them can leave train (each source needs one "
            "training document); add data"
        )
    splits = {"train": [d for d, v in zip(docs, is_val) if not v], "validation": [d for d, v in zip(docs, is_val) if v]}
    shard_bytes = int(cfg.shard_mb * 2**20)
    with quiet_datasets():
        files = {name: _write_split(part, ctx.out_dir / name, shard_bytes) for name, part in splits.items()}

    # The card.
    card = DataCard("Data card: cleaned documents")
    total_in = read_log.docs_in
    exact_log = next((s for s in steps if s.name == "exact_dedup"), None)
    near_log = next((s for s in steps if s.name == "near_dedup"), None)
    split_rows = [{"split": n, "documents": len(p), "bytes": sum(d.nbytes for d in p), "files": len(files[n])}
                  for n, p in splits.items()]
    summary = {
        "documents_in": total_in,
        "bytes_in": read_log.bytes_in,
        "documents_out": len(docs),
        "bytes_out": sum(d.nbytes for d in docs),
        "exact_duplicate_rate": (exact_log.drops["exact_duplicate"] / exact_log.docs_in) if exact_log and exact_log.docs_in else 0.0,
        "near_duplicate_rate": (near_log.drops["near_duplicate"] / near_log.docs_in) if near_log and near_log.docs_in else 0.0,
        "train_documents": len(splits["train"]),
        "validation_documents": len(splits["validation"]),
        "train_bytes": split_rows[0]["bytes"],
        "validation_bytes": split_rows[1]["bytes"],
        "secrets_scrubbed": sum(secrets.values()),
        "contaminated_documents": sum(contaminated.values()),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    card.figures("summary", "Summary", summary)
    card.table("steps", "Documents and bytes through every step", [s.row() for s in steps],
               ["step", "docs_in", "bytes_in", "docs_out", "bytes_out", "dropped", "drops"])
    drop_rows = [{"step": s.name, "reason": r, "documents": c, "examples": "; ".join(s.examples.get(r, [])[:3])}
                 for s in steps for r, c in sorted(s.drops.items())]
    card.table("drops", "Drops per reason", drop_rows, ["step", "reason", "documents", "examples"])
    card.table("secrets", "Secrets scrubbed per kind", [{"kind": k, "count": v} for k, v in sorted(secrets.items())],
               ["kind", "count"])
    source_rows = []
    for s in cfg.sources:
        info = per_source[s.name]
        source_rows.append({
            "source": s.name, "kind": s.kind, "weight": s.weight, "documents_read": info["documents_read"],
            "bytes_read": info["bytes_read"], "documents_kept": kept_per_source[s.name],
            "train_documents": sum(1 for d in splits["train"] if d.source == s.name),
            "validation_documents": sum(1 for d in splits["validation"] if d.source == s.name),
        })
    card.table("sources", "Sources (mixture weights are applied when packing tokens)", source_rows,
               ["source", "kind", "weight", "documents_read", "bytes_read", "documents_kept", "train_documents",
                "validation_documents"])
    card.table("splits", "Splits", split_rows, ["split", "documents", "bytes", "files"])
    eval_digest = hashlib.sha256("\x00".join(sorted(contamination.grams)).encode()).hexdigest()
    card.figures("decontamination", "Decontamination", {
        "ngram": cfg.decontaminate.ngram, "eval_sets": ", ".join(f"{k} ({len(v)})" for k, v in eval_sets.items()) or "none",
        "min_ngram": cfg.decontaminate.min_ngram, "eval_ngrams": len(contamination),
        "eval_texts_shorter_than_min_ngram": contamination.too_short,
        "eval_ngrams_sha256": eval_digest, "documents_dropped": sum(contaminated.values()),
    })
    if near_info:
        card.figures("near_dedup", "Near-duplicate detection (MinHash + LSH)",
                     {"threshold": cfg.dedup.threshold, "num_perm": cfg.dedup.num_perm, "shingle": cfg.dedup.shingle, **near_info})
    card.raw("files", files)
    card.raw("weights", {s.name: s.weight for s in cfg.sources})
    md = card.write(ctx.out_dir)

    ctx.log_metrics({f"data.{k}": float(v) for k, v in summary.items()}, None)
    ctx.log_artifact(md)
    ctx.log_artifact(ctx.out_dir / "data_card.json")
    return summary


def split_files(data_dir: Path, split: str) -> list[Path]:
    """The parquet shards of one split of a cleaned-data artifact; a clear error if the folder is not one."""
    folder = Path(data_dir) / split
    files = sorted(folder.glob("part-*.parquet"))
    if not files:
        raise DataSourceError(f"{folder}: no part-*.parquet files; is {data_dir} the output of the data stage (run_clean)?")
    return files


def iter_split_texts(data_dir: Path, split: str, max_bytes: int | None = None):
    """Texts of one split in stored order, stopping once max_bytes were yielded."""
    import pyarrow.parquet as pq

    taken = 0
    for f in split_files(data_dir, split):
        for text in pq.read_table(f, columns=["text"]).column("text").to_pylist():
            if max_bytes is not None and taken >= max_bytes:
                return
            taken += len(text.encode("utf-8", "surrogatepass"))
            yield text
