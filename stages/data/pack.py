"""`run_pack`: the cleaned documents, tokenized with the stage's tokenizer and packed into the trainer's
token shards (trainer/shards.py): EOS after every document, the stream cut into rows of seq_len + 1,
shards of about `data.shard_mb`, document starts kept in the index.

Tokenization runs through `datasets.map(batched=True, num_proc=data.num_proc)` shard by shard: the cleaned
parquet shards become an Arrow table on disk, the workers write their token ids to Arrow cache files, and
packing reads the ids zero-copy from those memory-mapped files, a document at a time; only per-document
figures (id, source, length) are held in memory, never the corpus or its tokens. Mixture weights are applied
here, on tokens: with T_s the training tokens of source s and W the sum of weights, source s contributes
w_s / W * sum(T) tokens, by taking whole passes over its documents and then documents in a seeded hash order
until the remainder is covered (a weight above its natural share repeats documents, one below drops some).
Training documents are then laid out source by source (sources in name order, each in a seeded hash order of
(document id, pass)), and the train index records each source's contiguous row range (`"sources"`), so the
trainer can re-weight sources at load time (a data mixture chosen by the ablations, trainer/data.py); the
loader's row permutation shuffles the sources together, so the default stream is the weighted mix as
before. Only the row where one source's tokens end and the next begin holds two sources; it counts for the
source owning most of it. Validation is packed unweighted, every document once, interleaved in hash order
(its first rows are a fair sample of the held-out mix).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from infra.progress import progress_bar
from trainer.shards import PackedShardWriter, token_dtype

from ..base import StageContext
from .card import DataCard, quiet_datasets
from .pipeline import split_files
from .sources import DataSourceError

SPLITS = {"train": "train", "validation": "val"}  # cleaned split -> token split folder (trainer's names)


def mix_key(seed: int, doc_id: str, repeat: int) -> int:
    """A document pass's place in the training order: 64 bits of blake2b over (seed, id, pass)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{doc_id}:{repeat}".encode(), digest_size=8).digest(), "big")


class EncodeBatch:
    """The batched map function; picklable (workers load the tokenizer file once, lazily)."""

    def __init__(self, tokenizer_file: str):
        self.tokenizer_file = tokenizer_file
        self._tok = None

    def __getstate__(self):
        return {"tokenizer_file": self.tokenizer_file, "_tok": None}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self._tok is None:
            from tokenizers import Tokenizer

            # One process per core already: no extra Rust threads inside each worker.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self._tok = Tokenizer.from_file(self.tokenizer_file)
            self._tok.encode_special_tokens = True  # "<|eos|>" written in a document is text, not a boundary
        texts = batch["text"]
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return {"ids": [np.asarray(e.ids, dtype=np.int32) for e in encs],
                "n_bytes": [len(t.encode("utf-8", "surrogatepass")) for t in texts]}


@contextmanager
def map_progress(desc: str):
    """datasets.map's own progress, drawn as our bar (infra/progress.py) in documents: map advances its
    bar as each worker of the pool reports batches done, so the bar moves while the pool works. Its bar
    class is swapped for ours for the duration of one map call (datasets' other bars stay silenced by
    quiet_datasets); the swap is module-wide, as stages/evaluate/run.py's for lm-eval is."""
    import datasets.arrow_dataset as arrow_dataset

    def bar(*_args, total=None, initial=0, **_kwargs):
        return progress_bar(total, desc, "doc", initial=initial)

    original = getattr(arrow_dataset, "hf_tqdm", None)
    if original is None:  # a datasets that renamed it: no bar rather than a failed stage (a test notices)
        yield
        return
    arrow_dataset.hf_tqdm = bar
    try:
        yield
    finally:
        arrow_dataset.hf_tqdm = original


def tokenize_split(files: list[Path], tokenizer_file: Path, num_proc: int, cache_dir: Path, name: str = "split"):
    """A datasets.Dataset with columns id, source, ids (int32), n_bytes, in stored order."""
    import datasets

    ds = datasets.Dataset.from_parquet([str(f) for f in files], cache_dir=str(cache_dir))
    features = datasets.Features({"id": datasets.Value("string"), "source": datasets.Value("string"),
                                  "ids": datasets.List(datasets.Value("int32")), "n_bytes": datasets.Value("int64")})
    with map_progress(f"tokens tokenize {name}"):
        return ds.map(EncodeBatch(str(tokenizer_file)), batched=True, batch_size=256,
                      num_proc=max(1, min(num_proc, len(ds))),
                      remove_columns=[c for c in ds.column_names if c not in ("id", "source")], features=features,
                      desc="tokenize")


class DocTokens:
    """Zero-copy access to each document's token ids in the mapped dataset's Arrow table."""

    def __init__(self, ds):
        col = ds.data.column("ids")
        self.values, self.starts, self.lengths, self.chunk = [], [], [], []
        for c, arr in enumerate(col.chunks):
            offs = arr.offsets.to_numpy()
            self.values.append(arr.values.to_numpy(zero_copy_only=False))
            self.starts.append(offs[:-1])
            self.lengths.append(np.diff(offs))
            self.chunk.append(np.full(len(arr), c))
        self.starts = np.concatenate(self.starts) if self.starts else np.zeros(0, np.int64)
        self.lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        self.chunk = np.concatenate(self.chunk) if self.chunk else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def token_counts(self, vocab: int) -> np.ndarray:
        """Occurrences of every token id, one Arrow chunk at a time (the memory-mapped table is never copied whole)."""
        bc = np.zeros(vocab, dtype=np.int64)
        for c, vals in enumerate(self.values):
            in_chunk = self.chunk == c
            if in_chunk.any():
                lo = int(self.starts[in_chunk].min())
                hi = int((self.starts[in_chunk] + self.lengths[in_chunk]).max())
                bc += np.bincount(np.asarray(vals[lo:hi], dtype=np.int64), minlength=vocab)[:vocab]
        return bc

    def __getitem__(self, i: int) -> np.ndarray:
        s = self.starts[i]
        return self.values[self.chunk[i]][s:s + self.lengths[i]]


def mixture_plan(ids: list[str], sources: list[str], tokens: np.ndarray, weights: dict[str, float], seed: int):
    """(order of (doc index, pass) entries, per-source rows). `tokens` counts each document's tokens + EOS."""
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(sources):
        by_source[s].append(i)
    total = int(tokens.sum())
    w_sum = sum(weights[s] for s in by_source)
    entries: list[tuple[int, int, int]] = []  # (key, doc, pass)
    rows = []
    for s, docs in sorted(by_source.items()):
        have = int(tokens[docs].sum())
        target = weights[s] / w_sum * total
        passes = int(target // have)
        remainder = target - passes * have
        ordered = sorted(docs, key=lambda i: mix_key(seed, ids[i], 0))
        for r in range(passes):
            entries += [(mix_key(seed, ids[i], r), i, r) for i in ordered]
        taken = passes * have
        cum = 0
        for i in ordered:
            if cum >= remainder:
                break
            entries.append((mix_key(seed, ids[i], passes), i, passes))
            cum += int(tokens[i])
        taken += cum
        rows.append({"source": s, "weight": weights[s], "tokens_available": have, "tokens_target": round(target),
                     "tokens_taken": taken, "share_target": weights[s] / w_sum, "share_taken": taken / total if total else 0.0,
                     "passes": taken / have if have else 0.0})
    entries.sort()
    return [(i, r) for _, i, r in entries], rows


def source_row_ranges(spans: list[tuple[str, int]], rows: int, row_len: int) -> list[dict]:
    """Contiguous row ranges from the stream's source spans [(name, tokens), ...] in stream order. A row
    cut by a span boundary goes to the source holding most of it (the boundary rounds to a row)."""
    out, start, tokens = [], 0, 0
    for k, (name, n) in enumerate(spans):
        tokens += n
        end = rows if k == len(spans) - 1 else min(rows, max(start, round(tokens / row_len)))
        out.append({"name": name, "start": start, "end": end})
        start = end
    return out


def record_sources(split_dir: Path, index: dict, spans: list[tuple[str, int]]) -> dict:
    """Add the per-source row ranges to a written split's index.json."""
    index = {**index, "sources": source_row_ranges(spans, index["rows"], index["seq_len"] + 1)}
    (Path(split_dir) / "index.json").write_text(json.dumps(index, indent=2))
    return index


def _pack_split(doc_tokens: DocTokens, order: list[int], out: Path, seq_len: int, vocab: int, eos_id: int,
                shard_mb: float, name: str) -> dict:
    row_bytes = (seq_len + 1) * token_dtype(vocab).itemsize
    writer = PackedShardWriter(out, seq_len, vocab, eos_id, rows_per_shard=max(1, int(shard_mb * 2**20 // row_bytes)))
    total = int((doc_tokens.lengths[np.asarray(order, dtype=np.int64)] + 1).sum())  # with an EOS per document
    with progress_bar(total, f"tokens pack {name}", "tok", unit_scale=True) as bar:
        for i in order:
            ids = doc_tokens[i]
            writer.add(ids)
            bar.update(len(ids) + 1)
    index = writer.close()
    if index["rows"] == 0:
        shutil.rmtree(out, ignore_errors=True)
        raise DataSourceError(
            f"{name} split: {index['dropped_tokens']} tokens from {index['documents']} documents do not fill one row of "
            f"seq_len+1={seq_len + 1}; add data, raise data.val_fraction, or lower pretrain.seq_len"
        )
    return index


def run_pack(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.cfg.data
    seq_len = ctx.cfg.pretrain.seq_len
    for key in ("data", "tokenizer"):
        if key not in ctx.inputs:
            raise ValueError(f"run_pack needs inputs[{key!r}] (the {key} artifact folder)")
    data_dir, tok_dir = Path(ctx.inputs["data"]), Path(ctx.inputs["tokenizer"])
    files = {split: split_files(data_dir, split) for split in SPLITS}
    from stages.tokenizer import load_tokenizer

    tok, eos_id = load_tokenizer(tok_dir)
    vocab = tok.get_vocab_size()
    if vocab > ctx.cfg.model.vocab_size:
        raise ValueError(f"{tok_dir}: tokenizer has {vocab} entries but model.vocab_size={ctx.cfg.model.vocab_size}: "
                         "ids would fall outside the embedding")
    weights = {s.name: s.weight for s in cfg.sources}
    t0 = time.perf_counter()
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="pack-", dir=ctx.workspace.path("scratch")))
    card = DataCard("Data card: packed tokens")
    summary: dict[str, Any] = {"seq_len": seq_len, "vocab_size": vocab, "eos_id": eos_id}
    try:
        split_rows = []
        for split, folder in SPLITS.items():
            with quiet_datasets():
                ds = tokenize_split(files[split], tok_dir / "tokenizer.json", cfg.num_proc, cache, split)
            docs = DocTokens(ds)
            ids, sources = ds["id"], ds["source"]
            lengths = docs.lengths.astype(np.int64)
            n_bytes = np.asarray(ds["n_bytes"], dtype=np.int64)
            if split == "train":
                unknown = sorted(set(sources) - set(weights))
                if unknown:
                    raise DataSourceError(f"{data_dir}: documents from source(s) {unknown} that data.sources does not name")
                absent = sorted(set(weights) - set(sources))
                if absent:
                    raise DataSourceError(
                        f"source(s) {absent} have no training documents in {data_dir} (all fell in validation, or the data "
                        "was cleaned with another source list): their mixture weight cannot be honoured"
                    )
                plan, mix_rows = mixture_plan(ids, sources, lengths + 1, weights, cfg.seed)
                # Stable sort: each source's passes keep their hash order, sources follow each other.
                order = sorted((i for i, _ in plan), key=lambda i: sources[i])
            else:
                order = sorted(range(len(docs)), key=lambda i: mix_key(cfg.seed, ids[i], 0))
            index = _pack_split(docs, order, ctx.out_dir / folder, seq_len, vocab, eos_id, cfg.shard_mb, split)
            if split == "train":
                spans: dict[str, int] = {}
                for i in order:
                    spans[sources[i]] = spans.get(sources[i], 0) + int(lengths[i]) + 1
                index = record_sources(ctx.out_dir / folder, index, list(spans.items()))
                mix_rows_by = {r["source"]: r for r in mix_rows}
                for r in index["sources"]:
                    mix_rows_by[r["name"]]["rows"] = r["end"] - r["start"]
            split_rows.append({"split": folder, "documents": index["documents"], "tokens": index["tokens"],
                               "dropped_tokens": index["dropped_tokens"], "rows": index["rows"],
                               "shards": len(index["shards"]), "bytes": int(n_bytes.sum()),
                               "bytes_per_token": float(n_bytes.sum() / max(1, lengths.sum()))})
            if split == "train":
                card.table("mixture", "Mixture: training tokens per source (weights applied here)", mix_rows,
                           ["source", "weight", "tokens_available", "tokens_target", "tokens_taken", "share_target",
                            "share_taken", "passes", "rows"])
            summary[f"{folder}_tokens"] = index["tokens"]
            summary[f"{folder}_rows"] = index["rows"]
            summary[f"{folder}_documents"] = index["documents"]
            if split == "validation":
                summary["val_bytes_per_token"] = round(float(n_bytes.sum() / max(1, lengths.sum())), 4)
            if split == "train":
                # Top tokens over the distinct training documents (before mixture repeats).
                bc = docs.token_counts(vocab)
                top = np.argsort(-bc)[:20]
                card.table("top_tokens", "Most frequent tokens (train)", [
                    {"id": int(t), "token": repr(tok.decode([int(t)])), "count": int(bc[t]), "share": float(bc[t] / max(1, bc.sum()))}
                    for t in top if bc[t] > 0], ["id", "token", "count", "share"])
            del ds, docs
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    summary["tokens_per_s"] = round((summary["train_tokens"] + summary["val_tokens"]) / max(1e-9, summary["seconds"]), 1)
    card.figures("summary", "Summary", summary)
    card.table("splits", "Token splits", split_rows,
               ["split", "documents", "tokens", "dropped_tokens", "rows", "shards", "bytes", "bytes_per_token"])
    md = card.write(ctx.out_dir)
    ctx.log_params({"pack.seq_len": seq_len, "pack.num_proc": cfg.num_proc, "pack.shard_mb": cfg.shard_mb})
    ctx.log_metrics({f"tokens.{k}": float(v) for k, v in summary.items()}, None)
    ctx.log_artifact(md)
    return summary
