"""The packed token shard format: what the data stage writes and the trainer's loader reads.

A split folder (`train/`, `val/`) holds:
  shard-00000.npy        2-D [rows, seq_len + 1] array (uint16 when vocab <= 65536, else uint32), np.save
                         format so `np.load(mmap_mode="r")` maps it without reading. Inputs are row[:-1],
                         targets row[1:]; consecutive rows continue the same token stream.
  shard-00000.docs.npy   int64 offsets (in the shard's flattened token stream) where documents start.
  index.json             {"format": "eightfold-packed-v1", "seq_len", "dtype", "vocab_size", "eos_id",
                          "rows", "tokens", "documents", "shards": [{"file", "docs", "rows"}]}
Documents are concatenated with EOS after each one; the tail that does not fill a row is dropped
(and counted in the index as `dropped_tokens`). A train split packed source by source also lists
`"sources": [{"name", "start", "end"}]`: contiguous row ranges that tile the split, which the loader
samples with data-mixture weights (trainer/data.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

FORMAT = "eightfold-packed-v1"
INDEX = "index.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class PackedShardWriter:
    """Append documents (lists of token ids, EOS added here); rows of seq_len + 1 are cut and sharded.

    Rows share boundary tokens with nothing: row r holds stream[r*(S+1):(r+1)*(S+1)], so every token
    is trained on exactly once as an input or target position.
    """

    def __init__(self, out_dir: str | Path, seq_len: int, vocab_size: int, eos_id: int, rows_per_shard: int):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.seq_len, self.vocab_size, self.eos_id = seq_len, vocab_size, eos_id
        self.row_len = seq_len + 1
        self.rows_per_shard = max(1, rows_per_shard)
        self.dtype = token_dtype(vocab_size)
        self._buf: list[np.ndarray] = []
        self._buf_tokens = 0
        self._doc_starts: list[int] = []
        self._shards: list[dict] = []
        self.documents = 0
        self.tokens = 0

    def add(self, ids: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        arr = np.append(arr, self.eos_id).astype(self.dtype)
        self._doc_starts.append(self._buf_tokens)
        self._buf.append(arr)
        self._buf_tokens += arr.size
        self.documents += 1
        self.tokens += arr.size
        if self._buf_tokens >= self.rows_per_shard * self.row_len:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        if not self._buf:
            return
        stream = np.concatenate(self._buf)
        starts = np.asarray(self._doc_starts, dtype=np.int64)
        n_rows = stream.size // self.row_len
        if not final:
            n_rows = min(n_rows, self.rows_per_shard)
        if n_rows == 0:
            return
        used = n_rows * self.row_len
        name = f"shard-{len(self._shards):05d}"
        np.save(self.out / f"{name}.npy", stream[:used].reshape(n_rows, self.row_len))
        np.save(self.out / f"{name}.docs.npy", starts[starts < used])
        self._shards.append({"file": f"{name}.npy", "docs": f"{name}.docs.npy", "rows": int(n_rows)})
        rest = stream[used:]
        # Only true document starts are recorded; a document cut by a shard edge continues unmarked.
        rest_starts = starts[starts >= used] - used
        self._buf = [rest] if rest.size else []
        self._doc_starts = [int(s) for s in rest_starts] if rest.size else []
        self._buf_tokens = int(rest.size)

    def close(self) -> dict:
        self._flush(final=True)
        dropped = self._buf_tokens
        self._buf, self._buf_tokens, self._doc_starts = [], 0, []
        index = {
            "format": FORMAT,
            "seq_len": self.seq_len,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "rows": sum(s["rows"] for s in self._shards),
            "tokens": self.tokens - dropped,
            "dropped_tokens": dropped,
            "documents": self.documents,
            "shards": self._shards,
        }
        (self.out / INDEX).write_text(json.dumps(index, indent=2))
        return index


class PackedShards:
    """Random access to the rows of a split folder, memory-mapped."""

    def __init__(self, split_dir: str | Path):
        self.dir = Path(split_dir)
        index_path = self.dir / INDEX
        if not index_path.is_file():
            raise FileNotFoundError(f"{index_path} not found: not a packed token split")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index_path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        self.seq_len = int(self.index["seq_len"])
        self._arrays = [np.load(self.dir / s["file"], mmap_mode="r") for s in self.index["shards"]]
        self._offsets = np.cumsum([0] + [a.shape[0] for a in self._arrays])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def row(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range (0..{len(self) - 1})")
        s = int(np.searchsorted(self._offsets, i, side="right") - 1)
        return np.asarray(self._arrays[s][i - self._offsets[s]], dtype=np.int64)

    def rows(self, indices: Iterable[int]) -> np.ndarray:
        return np.stack([self.row(int(i)) for i in indices])
