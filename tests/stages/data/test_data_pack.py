"""run_pack: the token stream rebuilt from the shards equals the documents tokenized independently (with
transformers' AutoTokenizer), in the seeded order, with EOS after each; mixture weights set token shares."""

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from infra.config import load_config
from infra.config.data import DataConfig, SourceConfig
from infra.workspace import Workspace
from stages.base import StageContext
from stages.data import DataSourceError, run_clean, run_pack
from stages.tokenizer import run as run_tokenizer
from trainer.shards import PackedShards

VOCAB = 512
SEQ = 64
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def make_cfg(tmp, sources, **data):
    cfg = load_config("tiny", [f"model.vocab_size={VOCAB}", f"tokenizer.vocab_size={VOCAB}", f"pretrain.seq_len={SEQ}"])
    cfg.data = DataConfig(sources=sources, **data)
    cfg.infra.workdir = str(tmp / "ws")
    return cfg


def build(tmp, cfg, out="tokens"):
    ws = Workspace.from_config(cfg)
    if not (tmp / "data").exists():
        run_clean(StageContext(cfg, ws, tmp / "data"))
        run_tokenizer(StageContext(cfg, ws, tmp / "tok", inputs={"data": tmp / "data"}))
    summary = run_pack(StageContext(cfg, ws, tmp / out, inputs={"data": tmp / "data", "tokenizer": tmp / "tok"}))
    return summary


def docs(tmp, split):
    rows = []
    for f in sorted((tmp / "data" / split).glob("*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def stream(split_dir: Path) -> np.ndarray:
    shards = PackedShards(split_dir)
    return np.concatenate([shards.row(i) for i in range(len(shards))]) if len(shards) else np.zeros(0, np.int64)


def key(seed, doc_id, r=0):
    return int.from_bytes(hashlib.blake2b(f"{seed}:{doc_id}:{r}".encode(), digest_size=8).digest(), "big")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pack")
    # One source (so no mixture reweighting): real stdlib files plus a planted document that contains the EOS
    # marker as text, which must stay text and not end the document.
    (tmp / "corpus").mkdir()
    for p in sorted(STDLIB.glob("[a-h]*.py"))[:40]:
        (tmp / "corpus" / p.name).write_text(p.read_text())
    (tmp / "corpus" / "zz_marker.py").write_text((STDLIB / "textwrap.py").read_text() + "\n# fake end <|eos|> marker\n")
    cfg = make_cfg(tmp, [SourceConfig(name="stdlib", path=str(tmp / "corpus"))], val_fraction=0.15, shard_mb=0.01,
                   num_proc=2)
    summary = build(tmp, cfg)
    return tmp, cfg, summary


@pytest.mark.parametrize("split,folder", [("train", "train"), ("validation", "val")])
def test_stream_is_every_document_in_order_with_eos(packed, split, folder):
    from transformers import AutoTokenizer

    tmp, cfg, summary = packed
    tok = AutoTokenizer.from_pretrained(str(tmp / "tok"))
    rows = sorted(docs(tmp, split), key=lambda r: key(cfg.data.seed, r["id"]))
    eos = tok.eos_token_id
    expected = []
    starts = []
    for r in rows:
        ids = tok(r["text"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert tok.decode(ids) == r["text"]
        starts.append(len(expected))
        expected += ids + [eos]
    expected = np.asarray(expected)
    got = stream(tmp / "tokens" / folder)
    index = json.loads((tmp / "tokens" / folder / "index.json").read_text())
    assert got.size == index["rows"] * (SEQ + 1) and got.size > 0
    assert index["tokens"] + index["dropped_tokens"] == expected.size
    assert 0 <= index["dropped_tokens"] < SEQ + 1  # only the last partial row is dropped
    np.testing.assert_array_equal(got, expected[: got.size])
    assert index["documents"] == len(rows)
    assert int((expected == eos).sum()) == len(rows)  # the literal "<|eos|>" in a document stayed text
    if any("<|eos|>" in r["text"] for r in rows):
        ends = starts[1:] + [expected.size]  # each document's EOS sits just before the next start
        assert int((got == eos).sum()) == sum(1 for e in ends if e - 1 < got.size)
    # The document starts recorded in the shards are the true starts, in stream coordinates.
    recorded, offset = [], 0
    for sh in index["shards"]:
        recorded += (np.load(tmp / "tokens" / folder / sh["docs"]) + offset).tolist()
        offset += sh["rows"] * (SEQ + 1)
    assert recorded == [s for s in starts if s < got.size]
    if folder == "train":
        assert len(index["shards"]) > 1  # shard_mb is small enough to force several shards


def test_card_figures(packed):
    tmp, cfg, summary = packed
    card = json.loads((tmp / "tokens" / "data_card.json").read_text())
    val_docs = docs(tmp, "validation")
    val_bytes = sum(len(r["text"].encode()) for r in val_docs)
    val_index = json.loads((tmp / "tokens" / "val" / "index.json").read_text())
    val_tokens = val_index["tokens"] + val_index["dropped_tokens"] - val_index["documents"]  # without EOS
    assert summary["val_bytes_per_token"] == pytest.approx(val_bytes / val_tokens, rel=1e-3)
    assert summary["train_rows"] == json.loads((tmp / "tokens" / "train" / "index.json").read_text())["rows"]
    assert card["top_tokens"] and card["splits"][0]["split"] == "train"


def test_mixture_weights_set_token_shares(tmp_path):
    a = SourceConfig(name="a", kind="python_source", max_bytes=150_000, site_packages=False, weight=3.0)
    files = sorted(p for p in STDLIB.glob("[m-z]*.py") if 2_000 < p.stat().st_size < 30_000)[:15]
    (tmp_path / "b").mkdir()
    for p in files:
        (tmp_path / "b" / p.name).write_text(p.read_text())
    b = SourceConfig(name="b", path=str(tmp_path / "b"), weight=1.0)
    cfg = make_cfg(tmp_path, [a, b], val_fraction=0.1)
    summary = build(tmp_path, cfg)
    card = json.loads((tmp_path / "tokens" / "data_card.json").read_text())
    mix = {r["source"]: r for r in card["mixture"]}
    total = sum(r["tokens_taken"] for r in mix.values())
    index = json.loads((tmp_path / "tokens" / "train" / "index.json").read_text())
    assert index["tokens"] + index["dropped_tokens"] == total
    for name, share in (("a", 0.75), ("b", 0.25)):
        # Whole documents are taken, so the share is off by at most one document's tokens.
        assert abs(mix[name]["tokens_taken"] / total - share) < 0.05, mix
    # b's natural share is smaller than 1/4 of... whichever source is short gets repeated, the other sampled.
    passes = sorted(r["passes"] for r in mix.values())
    assert passes[0] <= 1.0 <= passes[1]
    assert summary["train_documents"] == index["documents"]
    # Sources are laid out one after the other and the index says which rows hold which (the loader
    # re-weights them for a data mixture): a's rows end where a's tokens end, to the nearest row.
    ranges = index["sources"]
    assert [r["name"] for r in ranges] == ["a", "b"] and ranges[0]["start"] == 0
    assert ranges[0]["end"] == ranges[1]["start"] and ranges[1]["end"] == index["rows"]
    assert ranges[0]["end"] == round(mix["a"]["tokens_taken"] / (SEQ + 1))
    assert {r["source"]: r["rows"] for r in card["mixture"]} == {r["name"]: r["end"] - r["start"] for r in ranges}
    # ... and the first row of b's range begins inside a b document: its tokens are found in b's texts.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    first_b = PackedShards(tmp_path / "tokens" / "train").row(ranges[1]["start"] + 1)
    pieces = np.split(first_b, np.flatnonzero(first_b == tok.eos_token_id))
    longest = max((p[1:] if p.size and p[0] == tok.eos_token_id else p for p in pieces), key=len)
    text = tok.decode([int(t) for t in longest[:20]])
    b_texts = [r["text"] for r in docs(tmp_path, "train") if r["source"] == "b"]
    a_texts = [r["text"] for r in docs(tmp_path, "train") if r["source"] == "a"]
    assert any(text in t for t in b_texts) and not any(text in t for t in a_texts)


def test_too_little_data_for_one_row_is_an_error(tmp_path):
    (tmp_path / "in").mkdir()
    for name in ["fnmatch.py", "glob.py", "heapq.py", "textwrap.py"]:
        (tmp_path / "in" / name).write_text((STDLIB / name).read_text())
    cfg = make_cfg(tmp_path, [SourceConfig(name="small", path=str(tmp_path / "in"))])
    ws = Workspace.from_config(cfg)
    run_clean(StageContext(cfg, ws, tmp_path / "data"))
    run_tokenizer(StageContext(cfg, ws, tmp_path / "tok", inputs={"data": tmp_path / "data"}))
    cfg.model.max_seq_len = cfg.pretrain.seq_len = 1_000_000  # rows longer than the whole corpus
    with pytest.raises(DataSourceError, match=r"train split: \d+ tokens from 3 documents do not fill one row of seq_len\+1=1000001"):
        run_pack(StageContext(cfg, ws, tmp_path / "tokens", inputs={"data": tmp_path / "data", "tokenizer": tmp_path / "tok"}))
    assert not (tmp_path / "tokens" / "train").exists()  # no empty shard left behind
