"""`run_clean`: sources -> cleaned, deduplicated, decontaminated documents split into train/ and validation/
parquet shards, with a data card that accounts for every document and byte dropped on the way.

The work is a datatrove pipeline (steps.py) in four stages, run by `data.executor` (executors.py):

1. filter (one task per ~`data.task_mb` of input): read the task's files, normalise, our code rules,
   datatrove's GopherRepetitionFilter (and its C4/Gopher-quality/FineWeb filters when turned on), secrets
   scrubbing, decontamination; the survivors go to a scratch shard, and their MinHash and exact-hash
   signatures to datatrove's signature files.
2. buckets (one task per LSH band): datatrove's MinhashDedupBuckets finds the candidate pairs across shards.
3. clusters (one task): datatrove's ExactFindDedups, then our FirstKeptCluster (dedup.py) decides what goes.
4. write (one task per shard): datatrove's MinhashDedupFilter drops the duplicates, the train/validation tag
   by document hash, datatrove's ParquetWriter writes `{split}/part-{shard}.parquet`.

No stage holds more than a task's documents (stage 3 holds the duplicate pairs). Mixture weights are not
applied here: every kept document is written once, and `run_pack` samples documents so that each source's
share of training tokens follows its weight (tokens are only known after the tokenizer exists).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from infra.config import LifecycleConfig
from infra.config.data import DataConfig

from ..base import StageContext
from .card import DataCard
from .decontaminate import ContaminationIndex, eval_texts_by_source
from .dedup import FirstKeptCluster, exact_key, lsh_params, shard_priority, xxh64_text
from .executors import PipeStage, run_stages, start_pool_server
from .sources import DataSourceError, plan_tasks, validate_source
from .steps import (SEP, WORDS, AssignId, CodeRules, Decontaminate, DedupFilter, Measured, Normalize, ReadPlanned,
                    RunAll, ScrubSecrets, ShardReader, Signatures, SplitTag, merged_counts, output_row)

COLUMNS = ("id", "source", "origin", "text")
# The card's steps in pipeline order: (name, stats step name); dedup is one datatrove filter, shown as two steps.
STEP_ORDER = ["read", "normalize", "quality", "gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality",
              "scrub_secrets", "decontaminate", "exact_dedup", "near_dedup"]


def validate_data_config(cfg: DataConfig) -> None:
    for src in cfg.sources:
        validate_source(src)
    if cfg.executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise DataSourceError("data.executor=ray needs the `ray` package (pip install 'eightfold[ray]')") from None


def _minhash_config(cfg: DataConfig):
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.text import TextNormConfig

    bands, rows = lsh_params(cfg.dedup.threshold, cfg.dedup.num_perm)
    # Shingles of lower-cased word-character runs (steps.RegexWords), as the stage always had: the tokenizer
    # already drops punctuation and whitespace, and datatrove's per-character diacritics and number rewriting
    # would double the signature pass for no code-specific gain.
    norm = TextNormConfig(lowercase=True, norm_whitespace=False, remove_punctuation=False,
                          norm_unicode_diacritics=False, norm_numbers=False)
    return MinhashConfig(n_grams=cfg.dedup.shingle, num_buckets=bands, hashes_per_bucket=rows, seed=1,
                         norm_config=norm)


def repetition_filter(clean):
    """datatrove's GopherRepetitionFilter at the stage's thresholds: the duplicate-line share and the top 2/3/4-gram
    shares. Its paragraph and duplicate n-gram rules are off: the stage never had them, and code repeats by design."""
    from datatrove.pipeline.filters import GopherRepetitionFilter

    return GopherRepetitionFilter(dup_line_frac=clean.max_duplicate_line_fraction, dup_para_frac=None,
                                  dup_line_char_frac=None, dup_para_char_frac=None,
                                  top_n_grams=tuple(sorted(clean.top_ngram_max_fraction.items())), dup_n_grams=(),
                                  language=WORDS)


def build_stages(cfg: LifecycleConfig, plan_dir: Path, scratch: Path, logs: Path, out_dir: Path,
                 contamination: ContaminationIndex, n_tasks: int, cache_dir: Path) -> list[PipeStage]:
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactDedupSignature, ExactFindDedups
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupFilter, MinhashDedupSignature
    from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter, GopherQualityFilter
    from datatrove.pipeline.writers import JsonlWriter, ParquetWriter

    d, cc = cfg.data, cfg.data.clean
    L = str(logs / "filter")  # where the filter stage's steps leave examples
    filters: list = [
        ReadPlanned([s.model_dump() for s in d.sources], str(plan_dir), 4 * cc.max_chars, str(cache_dir), L),
        Normalize(cc.normalization, L),
        CodeRules(cc.model_dump(), L),
        Measured(repetition_filter(cc), "gopher_repetition", L),
    ]
    if cc.gopher_quality:
        filters.append(Measured(GopherQualityFilter(language=WORDS), "gopher_quality", L))
    if cc.c4_quality:
        filters.append(Measured(C4QualityFilter(language=WORDS), "c4_quality", L))
    if cc.fineweb_quality:
        filters.append(Measured(FineWebQualityFilter(language=WORDS), "fineweb_quality", L))
    if cc.scrub_secrets:
        filters.append(ScrubSecrets(L))
    if len(contamination):
        filters.append(Decontaminate(sorted(contamination.grams), sorted(contamination.lengths), L))
    filters.append(AssignId())
    filters.append(JsonlWriter(str(scratch / "filtered"), output_filename="${rank}.jsonl", compression=None,
                               adapter=output_row))
    mh = _minhash_config(d) if d.dedup.near else None
    ex_cfg = ExactDedupConfig(content_getter=exact_key, document_priority=shard_priority) if d.dedup.exact else None
    signature = None
    if mh:
        signature = MinhashDedupSignature(str(scratch / "minhash_sigs"), mh, language=WORDS)
        signature._hash_func = xxh64_text
    filters.append(Signatures(signature, ExactDedupSignature(str(scratch / "exact_sigs"), ex_cfg) if ex_cfg else None))
    stages = [PipeStage("filter", filters, n_tasks)]
    if mh or ex_cfg:
        if mh:
            stages.append(PipeStage("buckets", [MinhashDedupBuckets(str(scratch / "minhash_sigs"),
                                                                    str(scratch / "minhash_pairs"), config=mh)],
                                    mh.num_buckets))
        cluster: list = []
        if ex_cfg:
            cluster.append(ExactFindDedups(str(scratch / "exact_sigs"), str(scratch / "exact_dups"), ex_cfg))
        cluster.append(FirstKeptCluster(str(scratch / "minhash_pairs") if mh else None,
                                        str(scratch / "exact_dups") if ex_cfg else None, str(scratch / "remove")))
        stages.append(PipeStage("clusters", [RunAll(cluster)], 1))
    W = str(logs / "write")
    write: list = [ShardReader(str(scratch / "filtered"))]
    if mh or ex_cfg:
        write.append(DedupFilter(MinhashDedupFilter(str(scratch / "remove")), str(scratch / "remove"), W))
    write += [SplitTag(d.val_fraction, W),
              ParquetWriter(str(out_dir), output_filename="${split}/part-${rank}.parquet", adapter=output_row,
                            max_file_size=-1, schema=_schema(), use_content_defined_chunking=False,
                            write_page_index=False)]
    stages.append(PipeStage("write", write, n_tasks))
    return stages


def _schema():
    import pyarrow as pa

    return pa.schema([(c, pa.string()) for c in COLUMNS])


def _step_counts(stats: dict[str, list[list[dict]]]) -> dict[str, Counter]:
    """{step name: summed stat totals} over every task of every stage, for our accounted steps."""
    by_step: dict[str, list[dict]] = {}
    for tasks in stats.values():
        for task in tasks:
            for st in task:
                name = st["name"].split(": ", 1)[-1]
                by_step.setdefault(name, []).append(st["stats"])
    return {name: merged_counts(v) for name, v in by_step.items()}


def _examples(logs: Path) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for f in sorted(logs.glob("*/examples/*/*.json")):
        for reason, ex in json.loads(f.read_text()).items():
            have = out.setdefault(f.parent.name, {}).setdefault(reason, [])
            have.extend(ex[: 5 - len(have)])
    return out


class StepRow:
    """One card row rebuilt from a step's counts: totals and per-source figures."""

    def __init__(self, name: str, counts: Counter, only_reasons: set[str] | None = None,
                 docs_in: Counter | None = None, bytes_in: Counter | None = None):
        self.name = name
        self.drops: Counter = Counter()
        self.drop_bytes: Counter = Counter()
        self.source_drops: Counter = Counter()  # (source, reason) -> documents
        for label, v in counts.items():
            kind, _, rest = label.partition(SEP)
            if kind in ("drop", "drop_bytes"):
                src, _, reason = rest.partition(SEP)
                if only_reasons is not None and reason not in only_reasons:
                    continue
                if kind == "drop":
                    self.drops[reason] += v
                    self.source_drops[(src, reason)] += v
                else:
                    self.drop_bytes[reason] += v
        self.in_by_source = docs_in if docs_in is not None else _by_source(counts, "in")
        self.bytes_in_by_source = bytes_in if bytes_in is not None else _by_source(counts, "in_bytes")
        self.out_by_source = Counter(self.in_by_source)
        for (src, _), v in self.source_drops.items():
            self.out_by_source[src] -= v
        has_out = any(label.startswith(f"out{SEP}") for label in counts) and only_reasons is None
        self.bytes_out = sum(_by_source(counts, "out_bytes").values()) if has_out else \
            sum(self.bytes_in_by_source.values()) - sum(self.drop_bytes.values())

    @property
    def docs_in(self) -> int:
        return sum(self.in_by_source.values())

    @property
    def docs_out(self) -> int:
        return sum(self.out_by_source.values())

    def row(self) -> dict[str, Any]:
        return {"step": self.name, "docs_in": self.docs_in, "bytes_in": sum(self.bytes_in_by_source.values()),
                "docs_out": self.docs_out, "bytes_out": self.bytes_out, "dropped": self.docs_in - self.docs_out,
                "drops": ", ".join(f"{k}={v}" for k, v in sorted(self.drops.items())) or "-"}


def _by_source(counts: Counter, kind: str) -> Counter:
    out: Counter = Counter()
    for label, v in counts.items():
        k, _, src = label.partition(SEP)
        if k == kind:
            out[src] += v
    return out


def _fix_split(out_dir: Path, logs: Path, n_tasks: int) -> dict[str, int]:
    """split.assign_validation's two corrections for tiny corpora, from the write stage's per-shard extremes:
    a source with every document in validation gives its highest-fraction one to train; no validation document
    at all: the lowest-fraction document of a source with two or more goes to validation. Only the shards
    holding a moved document are rewritten. Returns the documents per split after the corrections."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    per_source: dict[str, dict[str, Any]] = {}
    for f in sorted((logs / "split").glob("*.json")):
        for src, e in json.loads(f.read_text()).items():
            agg = per_source.setdefault(src, {"max_val": None, "min_all": None})
            if e["max_val"] and (agg["max_val"] is None or e["max_val"][0] > agg["max_val"][0]):
                agg["max_val"] = e["max_val"]
            if agg["min_all"] is None or e["min_all"][0] < agg["min_all"][0]:
                agg["min_all"] = e["min_all"]
    counts = {split: _split_counts(out_dir, split) for split in ("train", "validation")}
    moves: list[tuple[str, str, int, str]] = []  # (id, from split, shard, to split)
    for src, agg in per_source.items():
        if counts["train"].get(src, 0) == 0 and agg["max_val"]:
            _, doc_id, shard = agg["max_val"]
            moves.append((doc_id, "validation", shard, "train"))
            counts["train"][src] = 1
            counts["validation"][src] -= 1
    if not sum(counts["validation"].values()):
        movable = [agg["min_all"] for src, agg in per_source.items()
                   if counts["train"].get(src, 0) + counts["validation"].get(src, 0) >= 2]
        if movable:
            _, doc_id, shard = min(movable)
            moves.append((doc_id, "train", shard, "validation"))
    for doc_id, src_split, shard, dst_split in moves:
        name = f"part-{shard:05d}.parquet"
        src_file, dst_file = out_dir / src_split / name, out_dir / dst_split / name
        table = pq.read_table(src_file)
        ids = table.column("id").to_pylist()
        keep = pa.array([i != doc_id for i in ids])
        moved = table.filter(pa.compute.invert(keep))
        rest = table.filter(keep)
        if rest.num_rows:
            pq.write_table(rest, src_file)
        else:
            src_file.unlink()
        dst_file.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables([pq.read_table(dst_file), moved]) if dst_file.exists() else moved, dst_file)
    return {split: sum(_split_counts(out_dir, split).values()) for split in ("train", "validation")}


def _split_counts(out_dir: Path, split: str) -> Counter:
    import pyarrow.parquet as pq

    c: Counter = Counter()
    for f in sorted((out_dir / split).glob("part-*.parquet")):
        c.update(pq.read_table(f, columns=["source"]).column("source").to_pylist())
    return c


def run_clean(ctx: StageContext) -> dict[str, Any]:
    import pyarrow.compute  # noqa: F401  (pa.compute in _fix_split)

    cfg = ctx.cfg.data
    t0 = time.perf_counter()
    start_pool_server(ctx.cfg)
    # Validate before work: every source resolvable, every evaluation file readable.
    validate_data_config(cfg)
    eval_sets = eval_texts_by_source(ctx.cfg)
    contamination = ContaminationIndex([t for ts in eval_sets.values() for t in ts], cfg.decontaminate.ngram,
                                       cfg.decontaminate.min_ngram)
    ctx.log_params({"data.sources": ",".join(f"{s.name}:{s.kind}:{s.weight}" for s in cfg.sources),
                    "data.dedup.threshold": cfg.dedup.threshold, "data.decontaminate.ngram": cfg.decontaminate.ngram,
                    "data.normalization": cfg.clean.normalization, "data.val_fraction": cfg.val_fraction,
                    "data.executor": cfg.executor, "data.workers": cfg.workers, "data.task_mb": cfg.task_mb})

    # A document longer than max_chars is dropped anyway; files beyond 4 bytes/char of that are not even read.
    tasks = plan_tasks(cfg.sources, 4 * cfg.clean.max_chars, max(1, int(cfg.task_mb * 2**20)))
    work = ctx.workspace.path("scratch", f"data-{uuid.uuid4().hex[:12]}")  # every node sees it (shared workdir)
    plan_dir, scratch, logs = work / "plan", work / "scratch", work / "logs"
    plan_dir.mkdir(parents=True)
    for rank, units in enumerate(tasks):
        (plan_dir / f"{rank:05d}.json").write_text(json.dumps(units))
    if ctx.out_dir.exists():  # leftovers of an interrupted attempt must not join this output
        shutil.rmtree(ctx.out_dir)
    ctx.out_dir.mkdir(parents=True)
    try:
        stages = build_stages(ctx.cfg, plan_dir, scratch, logs, ctx.out_dir, contamination, len(tasks),
                              ctx.workspace.path("scratch", "datasets-cache"))
        stats = run_stages(ctx.cfg, stages, logs)
        counts = _step_counts(stats)
        examples = _examples(logs)
        read = StepRow("read", counts["read"])
        empty = [s.name for s in cfg.sources if read.out_by_source[s.name] == 0]
        if empty:
            name = empty[0]
            drops = {r: c for (s, r), c in read.source_drops.items() if s == name}
            what = f"; dropped while reading: {drops} e.g. {examples.get('read', {})}" if drops else ""
            raise DataSourceError(f"source {name!r} yielded no documents{what}")
        rows = _card_rows(counts, read)
        last = rows[-1]
        kept_per_source = last.out_by_source
        no_docs = [s.name for s in cfg.sources if kept_per_source[s.name] == 0]
        if no_docs:
            lost = {name: {f"{r.name}/{reason}": c for r in rows for (s, reason), c in r.source_drops.items() if s == name}
                    for name in no_docs}
            raise DataSourceError(
                f"source(s) {no_docs} yielded zero documents after filtering (drops: {lost}); loosen data.clean or remove the source"
            )
        if last.docs_out < 2:
            raise DataSourceError(f"only {last.docs_out} document(s) left after filtering: need at least 2 for a train/validation split")
        split_docs = _fix_split(ctx.out_dir, logs / "write", len(tasks))
        if not split_docs["validation"]:
            raise DataSourceError(
                f"no validation document: {last.docs_out} documents left, none of them can leave train (each source needs one "
                "training document); add data"
            )
    except BaseException:
        shutil.rmtree(ctx.out_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _write_card(ctx, cfg, rows, counts, examples, eval_sets, contamination, tasks, t0)


def _card_rows(counts: dict[str, Counter], read: "StepRow") -> list["StepRow"]:
    rows = [read]
    for name in STEP_ORDER[1:]:
        if name in ("exact_dedup", "near_dedup"):
            if "dedup" not in counts:
                continue
            reason = "exact_duplicate" if name == "exact_dedup" else "near_duplicate"
            prev = rows[-1]
            rows.append(StepRow(name, counts["dedup"], {reason}, Counter(prev.out_by_source),
                                _bytes_out_by_source(prev, counts)))
        elif name in counts:
            rows.append(StepRow(name, counts[name]))
    return rows


def _bytes_out_by_source(prev: "StepRow", counts: dict[str, Counter]) -> Counter:
    """Bytes per source leaving `prev`, for the dedup rows (which share one datatrove filter's counts)."""
    if prev.name == "exact_dedup":
        out = Counter(prev.bytes_in_by_source)
        for label, v in counts["dedup"].items():
            kind, _, rest = label.partition(SEP)
            src, _, reason = rest.partition(SEP)
            if kind == "drop_bytes" and reason == "exact_duplicate":
                out[src] -= v
        return out
    return _by_source(counts[prev.name], "out_bytes")


def _write_card(ctx, cfg, rows, counts, examples, eval_sets, contamination, tasks, t0) -> dict[str, Any]:
    import pyarrow.parquet as pq

    card = DataCard("Data card: cleaned documents")
    read, last = rows[0], rows[-1]
    by_name = {r.name: r for r in rows}
    splits: dict[str, dict[str, Any]] = {}
    for split in ("train", "validation"):
        files = sorted(p.name for p in (ctx.out_dir / split).glob("part-*.parquet"))
        docs = bytes_ = 0
        per_source: Counter = Counter()
        for f in files:
            t = pq.read_table(ctx.out_dir / split / f, columns=["source", "text"])
            srcs = t.column("source").to_pylist()
            per_source.update(srcs)
            docs += t.num_rows
            bytes_ += sum(len(x.encode("utf-8", "surrogatepass")) for x in t.column("text").to_pylist())
        splits[split] = {"files": files, "documents": docs, "bytes": bytes_, "per_source": per_source}
    secrets = {label.split(SEP, 1)[1]: v for label, v in counts.get("scrub_secrets", Counter()).items()
               if label.startswith(f"secret{SEP}")}
    exact, near = by_name.get("exact_dedup"), by_name.get("near_dedup")
    decon = by_name.get("decontaminate")
    summary = {
        "documents_in": read.docs_in,
        "bytes_in": sum(read.bytes_in_by_source.values()),
        "documents_out": last.docs_out,
        "bytes_out": splits["train"]["bytes"] + splits["validation"]["bytes"],
        "exact_duplicate_rate": exact.drops["exact_duplicate"] / exact.docs_in if exact and exact.docs_in else 0.0,
        "near_duplicate_rate": near.drops["near_duplicate"] / near.docs_in if near and near.docs_in else 0.0,
        "train_documents": splits["train"]["documents"],
        "validation_documents": splits["validation"]["documents"],
        "train_bytes": splits["train"]["bytes"],
        "validation_bytes": splits["validation"]["bytes"],
        "secrets_scrubbed": sum(secrets.values()),
        "contaminated_documents": decon.drops["eval_ngram_overlap"] if decon else 0,
        "tasks": len(tasks),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    card.figures("summary", "Summary", summary)
    card.table("steps", "Documents and bytes through every step", [r.row() for r in rows],
               ["step", "docs_in", "bytes_in", "docs_out", "bytes_out", "dropped", "drops"])
    drop_rows = []
    for r in rows:
        ex = examples.get("dedup" if r.name in ("exact_dedup", "near_dedup") else r.name, {})
        for reason, c in sorted(r.drops.items()):
            drop_rows.append({"step": r.name, "reason": reason, "documents": c, "examples": "; ".join(ex.get(reason, [])[:3])})
    card.table("drops", "Drops per reason", drop_rows, ["step", "reason", "documents", "examples"])
    source_drop_rows = [{"source": s, "step": r.name, "reason": reason, "documents": c}
                        for r in rows for (s, reason), c in sorted(r.source_drops.items())]
    card.table("source_drops", "Drops per source and reason", source_drop_rows, ["source", "step", "reason", "documents"])
    card.table("secrets", "Secrets scrubbed per kind", [{"kind": k, "count": v} for k, v in sorted(secrets.items())],
               ["kind", "count"])
    source_rows = []
    for s in cfg.sources:
        source_rows.append({
            "source": s.name, "kind": s.kind, "weight": s.weight, "documents_read": read.out_by_source[s.name],
            "bytes_read": read.bytes_in_by_source[s.name] - sum(
                v for label, v in counts["read"].items() if label.startswith(f"drop_bytes{SEP}{s.name}{SEP}")),
            "documents_kept": last.out_by_source[s.name],
            "train_documents": splits["train"]["per_source"][s.name],
            "validation_documents": splits["validation"]["per_source"][s.name],
        })
    card.table("sources", "Sources (mixture weights are applied when packing tokens)", source_rows,
               ["source", "kind", "weight", "documents_read", "bytes_read", "documents_kept", "train_documents",
                "validation_documents"])
    split_rows = [{"split": n, "documents": v["documents"], "bytes": v["bytes"], "files": len(v["files"])}
                  for n, v in splits.items()]
    card.table("splits", "Splits", split_rows, ["split", "documents", "bytes", "files"])
    eval_digest = hashlib.sha256("\x00".join(sorted(contamination.grams)).encode()).hexdigest()
    card.figures("decontamination", "Decontamination", {
        "ngram": cfg.decontaminate.ngram, "eval_sets": ", ".join(f"{k} ({len(v)})" for k, v in eval_sets.items()) or "none",
        "min_ngram": cfg.decontaminate.min_ngram, "eval_ngrams": len(contamination),
        "eval_texts_shorter_than_min_ngram": contamination.too_short,
        "eval_ngrams_sha256": eval_digest, "documents_dropped": summary["contaminated_documents"],
    })
    if cfg.dedup.near:
        mh = _minhash_config(cfg)
        card.figures("near_dedup", "Near-duplicate detection (datatrove MinHash + LSH)",
                     {"threshold": cfg.dedup.threshold, "num_perm": cfg.dedup.num_perm, "shingle": cfg.dedup.shingle,
                      "bands": mh.num_buckets, "rows": mh.hashes_per_bucket,
                      "hashes_used": mh.num_buckets * mh.hashes_per_bucket})
    card.figures("execution", "Execution (datatrove)", {"executor": cfg.executor, "workers": cfg.workers,
                                                         "tasks": len(tasks), "task_mb": cfg.task_mb})
    card.raw("files", {n: v["files"] for n, v in splits.items()})
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
