"""Fixtures for the export tests: a byte-level BPE tokenizer made by the tokenizer stage's own functions,
and a tiny model trained for a few seconds on standard-library source so its perplexity means something
(a random model's outputs are nearly uniform, and a broken conversion would hardly change them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from export_models import VOCAB, Trained, single_thread, stdlib_texts, tiny_cfg, token_rows, train_briefly


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def export_tokenizer_dir(tmp_path_factory) -> Path:
    from stages.tokenizer import save_hf, train_bpe

    out = tmp_path_factory.mktemp("export_tokenizer")
    save_hf(train_bpe(stdlib_texts(), VOCAB, 2), out)
    return out


@pytest.fixture(scope="session")
def trained_tiny(export_tokenizer_dir) -> Trained:
    train, val = token_rows(export_tokenizer_dir)
    with single_thread():
        return train_briefly(tiny_cfg(), train, val)
