"""Tokenizer training shows the `tokenizers` library's own bars on a terminal (documents read, words,
merges, each to its total) and writes nothing at all where stderr is not one (CI, a Prefect worker)."""

import json
import os
import pty
import re
import sysconfig
import threading
from pathlib import Path

from stages.tokenizer import train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 600


def texts() -> list[str]:
    return [p.read_text() for p in sorted(STDLIB.glob("[a-c]*.py"))[:12]]


def on_a_terminal(fn):
    """Run fn() with file descriptor 2 on a pseudo-terminal; returns (fn's result, what it drew)."""
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # the other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    saved = os.dup(2)
    os.dup2(slave, 2)
    try:
        result = fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    return result, b"".join(chunks).decode("utf-8", "replace")


def last_count(drawn: str, phase: str) -> tuple[int, int]:
    """(done, total) of the last redraw of an indicatif bar named `phase`."""
    counts = re.findall(re.escape(phase) + r"\s+\S+\s+(\d+)\s*/\s*(\d+)", drawn)
    assert counts, f"no {phase!r} bar in:\n{drawn[-2000:]}"
    return tuple(int(x) for x in counts[-1])


def test_training_on_a_terminal_draws_the_library_bars_to_their_totals():
    docs = texts()
    tok, drawn = on_a_terminal(lambda: train_bpe(docs, VOCAB, 2))
    merges = len(json.loads(tok.to_str())["model"]["merges"])
    assert merges > 100
    assert last_count(drawn, "Pre-processing sequences") == (len(docs), len(docs))  # one per document
    done, total = last_count(drawn, "Tokenize words")
    assert done == total > len(docs)
    assert last_count(drawn, "Compute merges") == (merges, merges)


def test_training_off_a_terminal_writes_nothing(capfd):
    assert not os.isatty(2)  # pytest's capture: a file, as a CI runner's or a Prefect worker's stderr
    tok = train_bpe(texts(), VOCAB, 2)
    out, err = capfd.readouterr()
    assert tok.get_vocab_size() == VOCAB
    assert (out, err) == ("", "")
