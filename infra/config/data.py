"""`data:` and `tokenizer:` sources, cleaning, dedup, decontamination, split, packing; the BPE tokenizer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class SourceConfig(Section):
    """One corpus in the mixture."""

    name: str = Field(..., min_length=1, description="label used in the data card")
    kind: Literal["python_source", "files", "hf"] = Field(
        "files", description="python_source: the running Python's .py files; files: local json/jsonl/parquet/text; hf: a hub dataset"
    )
    path: str | None = Field(None, description="files: file, folder or glob; hf: dataset name")
    format: Literal["auto", "json", "jsonl", "parquet", "text"] = "auto"
    text_field: str = "text"
    split: str = "train"
    weight: float = Field(1.0, gt=0, description="mixture weight (relative share of training tokens)")
    max_documents: int | None = Field(None, ge=1)
    max_bytes: int | None = Field(None, ge=1, description="stop reading once this many bytes were taken")


class CleanConfig(Section):
    min_chars: int = Field(64, ge=0)
    max_chars: int = Field(200_000, ge=1)
    max_line_chars: int = Field(1_000, ge=1)
    max_symbol_ratio: float = Field(0.3, ge=0, le=1)
    max_digit_ratio: float = Field(0.3, ge=0, le=1)
    max_duplicate_line_fraction: float = Field(0.3, ge=0, le=1)
    max_top_ngram_fraction: float = Field(0.2, ge=0, le=1)
    scrub_secrets: bool = True


class DedupConfig(Section):
    exact: bool = True
    near: bool = True
    threshold: float = Field(0.8, gt=0, le=1, description="Jaccard similarity above which documents are near-duplicates")
    num_perm: int = Field(128, ge=16)
    shingle: int = Field(5, ge=1, description="word n-gram size of the MinHash shingles")


class DataConfig(Section):
    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(name="python", kind="python_source")])
    clean: CleanConfig = Field(default_factory=CleanConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    decontaminate_ngram: int = Field(13, ge=1)
    val_fraction: float = Field(0.02, gt=0, lt=1)
    num_proc: int = Field(2, ge=1)
    shard_mb: float = Field(64.0, gt=0)


class TokenizerConfig(Section):
    kind: Literal["byte_bpe"] = "byte_bpe"
    vocab_size: int = Field(32000, ge=300)
    min_frequency: int = Field(2, ge=1)
    train_bytes: int | None = Field(None, ge=1, description="cap the text used to train (default: all of train)")
