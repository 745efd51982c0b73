"""Reading the configured sources into plain documents, with every unreadable file counted, never skipped silently.

A source is a local json/jsonl/parquet/text file, folder or glob, a Hugging Face hub dataset, or the built-in
offline corpus `python_source`: the .py files of the running Python (standard library, then site-packages),
walked in sorted order so the same installation always yields the same documents.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from infra.config.data import SourceConfig

TEXT_SUFFIXES = {".txt", ".text", ".md", ".py", ".rst"}
FORMAT_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
TEST_DIRS = {"test", "tests", "idle_test"}


class DataSourceError(ValueError):
    """A source that cannot be read or yields nothing usable; the message names the source and the file."""


@dataclass
class Document:
    source: str
    origin: str  # file path (or hub dataset name + row) the text came from
    text: str


@dataclass
class ReadStats:
    """What reading one source took in and what it dropped before any cleaning rule ran."""

    documents: int = 0
    bytes: int = 0
    drops: Counter = field(default_factory=Counter)
    drop_bytes: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def drop(self, reason: str, origin: str, nbytes: int) -> None:
        self.drops[reason] += 1
        self.drop_bytes[reason] += nbytes
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < 5:
            self.examples[reason].append(origin)


def python_source_roots(src: SourceConfig) -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])]
    if src.site_packages:
        for key in ("purelib", "platlib"):
            p = Path(paths[key])
            if p not in roots:
                roots.append(p)
    return [r for r in roots if r.is_dir()]


def _walk_py(root: Path, skip: set[Path], exclude_tests: bool) -> Iterator[Path]:
    """Depth-first, sorted: the order depends only on the file tree."""
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and d != "__pycache__" and here / d not in skip
            and not (exclude_tests and d in TEST_DIRS)
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield here / name


def resolve_files(src: SourceConfig) -> list[Path]:
    """The files a `files` source names (file, folder or glob), sorted; raises if there are none."""
    assert src.path is not None
    p = Path(src.path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
    elif any(ch in src.path for ch in "*?["):
        files = sorted(Path(q) for q in glob.glob(str(p), recursive=True) if Path(q).is_file())
    else:
        raise DataSourceError(f"source {src.name!r}: path {src.path!r} does not exist")
    if not files:
        raise DataSourceError(f"source {src.name!r}: no files under {src.path!r}")
    return files


def file_format(src: SourceConfig, path: Path) -> str:
    if src.format != "auto":
        return "json" if src.format == "jsonl" else src.format
    suffix = path.suffix.lower()
    if suffix in FORMAT_BY_SUFFIX:
        return FORMAT_BY_SUFFIX[suffix]
    if suffix in TEXT_SUFFIXES or suffix == "":
        return "text"
    raise DataSourceError(
        f"source {src.name!r}: cannot tell the format of {path} (suffix {suffix!r}); set `format:` to json, jsonl, parquet or text"
    )


def validate_source(src: SourceConfig) -> None:
    """Cheap checks before any work starts: the files exist and have a known format."""
    if src.kind == "python_source":
        if not python_source_roots(src):
            raise DataSourceError(f"source {src.name!r}: no standard library folder found via sysconfig")
    elif src.kind == "files":
        for f in resolve_files(src):
            file_format(src, f)


def _json_rows(path: Path) -> Iterator[dict]:
    """JSON lines, one object per line (blank lines skipped); a file that is one JSON array of objects is read
    whole. Bytes that are not UTF-8 fail (UnicodeDecodeError) rather than being replaced."""
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
        f.seek(0)
        if head.startswith(b"["):
            rows = json.loads(f.read().decode("utf-8"))
        else:
            rows = (json.loads(line.decode("utf-8")) for line in f if line.strip())
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise ValueError(f"row {n} is a JSON {type(row).__name__}, not an object")
            yield row


def _parquet_rows(path: Path, field: str) -> Iterator[dict]:
    """Rows of a Parquet file, a record batch at a time, with only `field` read when the file has it (all
    columns' names otherwise, for the caller's error)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if field not in names:
        yield dict.fromkeys(names)
        return
    for batch in pf.iter_batches(columns=[field], batch_size=256):
        for value in batch.column(0).to_pylist():
            yield {field: value}


class SourceReader:
    """Yields the documents of one source, stopping at max_documents / max_bytes, counting what it drops.

    `files` reads just those files of the source (a task's share, see `plan_tasks`); the source's limits were
    then applied when the files were planned, so they are not applied again here."""

    def __init__(self, src: SourceConfig, max_doc_bytes: int, cache_dir: Path | None = None,
                 files: list[str] | None = None):
        self.src = src
        self.files = [Path(f) for f in files] if files is not None else None
        # hub sources: datasets' lock and cache files go here
        self.cache_dir = str(cache_dir) if cache_dir is not None else None
        self.stats = ReadStats()
        # Anything far larger than the longest document we keep is dropped unread (a 50 MB one-line file).
        self.max_doc_bytes = max_doc_bytes

    def _full(self) -> bool:
        if self.files is not None:
            return False
        s = self.src
        return (s.max_documents is not None and self.stats.documents >= s.max_documents) or (
            s.max_bytes is not None and self.stats.bytes >= s.max_bytes
        )

    def _take_bytes(self, raw: bytes, origin: str) -> Document | None:
        if not raw.strip():
            self.stats.drop("empty", origin, len(raw))
            return None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.stats.drop("not_utf8", f"{origin} (byte {exc.start})", len(raw))
            return None
        return self._take_text(text, origin, len(raw))

    def _take_text(self, text: str | None, origin: str, nbytes: int | None = None) -> Document | None:
        if text is None or not str(text).strip():
            self.stats.drop("empty", origin, 0 if text is None else len(str(text).encode("utf-8", "replace")))
            return None
        text = str(text)
        nbytes = len(text.encode("utf-8", "surrogatepass")) if nbytes is None else nbytes
        self.stats.documents += 1
        self.stats.bytes += nbytes
        return Document(self.src.name, origin, text)

    def _read_file_bytes(self, path: Path) -> Document | None:
        size = path.stat().st_size
        if size > self.max_doc_bytes:
            self.stats.drop("file_too_large", f"{path} ({size} bytes)", size)
            return None
        return self._take_bytes(path.read_bytes(), str(path))

    def __iter__(self) -> Iterator[Document]:
        kind = self.src.kind
        if self.files is not None:
            yield from self._listed()
        elif kind == "python_source":
            yield from self._python_source()
        elif kind == "files":
            yield from self._files()
        else:
            yield from self._hub()

    def _python_source(self) -> Iterator[Document]:
        for path in python_source_files(self.src):
            if self._full():
                return
            doc = self._read_file_bytes(path)
            if doc is not None:
                yield doc

    def _listed(self) -> Iterator[Document]:
        for path in self.files:
            if self.src.kind == "python_source" or file_format(self.src, path) == "text":
                doc = self._read_file_bytes(path)
                if doc is not None:
                    yield doc
            else:
                yield from self._table_file(path, file_format(self.src, path))

    def _files(self) -> Iterator[Document]:
        for path in resolve_files(self.src):
            if self._full():
                return
            fmt = file_format(self.src, path)
            if fmt == "text":
                doc = self._read_file_bytes(path)  # one document per file, decoded here so bad bytes are counted
                if doc is not None:
                    yield doc
            else:
                yield from self._table_file(path, fmt)

    def _table_file(self, path: Path, fmt: str) -> Iterator[Document]:
        """The `text_field` of each row of a JSON-lines or Parquet file, streamed: a line or a record batch at a
        time, read with the json module and pyarrow as datatrove's own JsonlReader and ParquetReader do.
        datasets' `load_dataset` would cost ~0.1 s a file and import torch (2 s) in every pool worker."""
        field = self.src.text_field
        try:
            rows = _json_rows(path) if fmt == "json" else _parquet_rows(path, field)
            for row_no, row in enumerate(rows):
                if row_no == 0 and field not in row:
                    raise DataSourceError(
                        f"source {self.src.name!r}: {path} has no field {field!r} (fields: {sorted(row)}); set `text_field:`"
                    )
                if self._full():
                    return
                # a later row without the field reads as empty (dropped and counted), as datasets read it
                doc = self._take_text(row.get(field), f"{path}:{row_no}")
                if doc is not None:
                    yield doc
        except DataSourceError:
            raise
        except Exception as exc:  # name the file, not the parser's frame
            raise DataSourceError(f"source {self.src.name!r}: cannot read {path} as {fmt}: {type(exc).__name__}: {exc}") from exc

    def _hub(self) -> Iterator[Document]:
        import datasets

        try:
            ds = datasets.load_dataset(self.src.path, self.src.hf_config, split=self.src.split, streaming=True,
                                       cache_dir=self.cache_dir)
            for row_no, row in enumerate(ds):
                if self._full():
                    return
                if self.src.text_field not in row:
                    raise DataSourceError(
                        f"source {self.src.name!r}: hub dataset {self.src.path!r} has no field {self.src.text_field!r} (fields: {sorted(row)})"
                    )
                doc = self._take_text(row[self.src.text_field], f"{self.src.path}:{self.src.split}:{row_no}")
                if doc is not None:
                    yield doc
        except DataSourceError:
            raise
        except Exception as exc:
            raise DataSourceError(
                f"source {self.src.name!r}: cannot load hub dataset {self.src.path!r} split {self.src.split!r} "
                f"(offline, or no such dataset?): {type(exc).__name__}: {exc}"
            ) from exc


# --- planning: the sources cut into tasks of about `task_bytes` ---------------------------------------------

def python_source_files(src: SourceConfig) -> Iterator[Path]:
    """The .py files of python_source, in reading order (walked lazily: a byte limit stops the walk early)."""
    roots = python_source_roots(src)
    for i, root in enumerate(roots):
        # The stdlib folder contains its own site-packages; each root is walked once.
        skip = {r for r in roots[i + 1:]} | {root / "site-packages"}
        yield from _walk_py(root, skip, src.exclude_tests)


def _planned_files(src: SourceConfig, max_doc_bytes: int) -> list[tuple[str, int]] | None:
    """(path, size) of the files a source is read from, its limits applied by file size; None when the source
    must be read whole by one task (a hub dataset, or table files under a limit: rows are only counted by reading).

    A file counts against max_bytes/max_documents as the reader would count it if it holds a readable document
    (non-empty, at most max_doc_bytes); an undecodable one is found only when read, so it counts here too."""
    if src.kind == "hf":
        return None
    limited = src.max_documents is not None or src.max_bytes is not None
    if src.kind == "python_source":
        paths = python_source_files(src)
    else:
        paths = resolve_files(src)
        if limited and any(file_format(src, p) != "text" for p in paths):
            return None
    out, docs, nbytes = [], 0, 0
    for p in paths:
        if (src.max_documents is not None and docs >= src.max_documents) or (
                src.max_bytes is not None and nbytes >= src.max_bytes):
            break
        size = p.stat().st_size
        if 0 < size <= max_doc_bytes:
            docs += 1
            nbytes += size
        out.append((str(p), size))
    return out


def plan_tasks(sources: list[SourceConfig], max_doc_bytes: int, task_bytes: int) -> list[list[dict]]:
    """The read work cut into tasks: each a list of {"source", "files"} units (files None: the whole source),
    contiguous in source order and about task_bytes of input each. It depends on the input alone, never on
    how many workers run it, so every executor writes the same shards."""
    tasks: list[list[dict]] = []
    current: list[dict] = []
    size = 0

    def close():
        nonlocal current, size
        if current:
            tasks.append(current)
        current, size = [], 0

    for src in sources:
        files = _planned_files(src, max_doc_bytes)
        if files is None:
            close()
            tasks.append([{"source": src.name, "files": None}])
            continue
        for path, nbytes in files:
            if current and current[-1]["source"] == src.name:
                current[-1]["files"].append(path)
            else:
                current.append({"source": src.name, "files": [path]})
            size += nbytes
            if size >= task_bytes:
                close()
    close()
    return tasks
