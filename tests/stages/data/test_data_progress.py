"""Progress bars of the data and tokens stages on a small slice of the standard library: every cleaning
step and both near-dedup passes count the documents the data card says went in; tokenization counts
documents as the worker pool finishes batches, packing counts the tokens the shards' index records.
Bars are read back from stderr (pytest's capture: no terminal, as in CI or on a Prefect worker)."""

import json
import sysconfig
from pathlib import Path

from tqdm import tqdm

from fixtures.progress import bar_names, final
from infra.config import load_config
from infra.config.data import DataConfig, SourceConfig
from infra.workspace import Workspace
from stages.base import StageContext
from stages.data import run_clean, run_pack
from stages.tokenizer import run as run_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def make_cfg(tmp, **data):
    cfg = load_config("tiny", ["model.vocab_size=512", "tokenizer.vocab_size=512", "pretrain.seq_len=64"])
    cfg.data = DataConfig(sources=[SourceConfig(name="stdlib", kind="python_source", max_bytes=150_000,
                                                site_packages=False)], **data)
    cfg.infra.workdir = str(tmp / "ws")
    return cfg


def step_docs_in(out: Path) -> dict[str, int]:
    return {s["step"]: s["docs_in"] for s in json.loads((out / "data_card.json").read_text())["steps"]}


def record_updates(monkeypatch, module) -> dict[str, list[float]]:
    """Wrap `module.progress_bar` so each bar's update sizes are kept, by name (the bars still draw)."""
    real = module.progress_bar
    updates: dict[str, list[float]] = {}

    def recording(total, desc, unit, **kwargs):
        bar = real(total, desc, unit, **kwargs)
        sizes = updates.setdefault(desc, [])
        update = bar.update

        def counted(n=1):
            sizes.append(n)
            return update(n)

        bar.update = counted
        return bar

    monkeypatch.setattr(module, "progress_bar", recording)
    return updates


def test_every_cleaning_step_counts_its_documents(tmp_path, capsys):
    cfg = make_cfg(tmp_path)
    run_clean(StageContext(cfg, Workspace.from_config(cfg), tmp_path / "data"))
    err = capsys.readouterr().err
    docs_in = step_docs_in(tmp_path / "data")
    shown = [s for s in docs_in if s not in ("read", "near_dedup")]  # reading has no bar; near dedup: below
    assert {"normalize", "quality", "scrub_secrets", "exact_dedup"} <= set(shown)
    for step in shown:
        bar = final(err, f"data {step}")
        assert (bar.percent, bar.n, bar.total, bar.unit) == (100, str(docs_in[step]), str(docs_in[step]), "doc")
    names = bar_names(err)
    assert [n for n in names if n.removeprefix("data ") in shown] == [f"data {s}" for s in shown]  # in step order


def test_near_dedup_counts_documents_in_both_passes(tmp_path, capsys, monkeypatch):
    import stages.data.pipeline as pipeline

    monkeypatch.setattr(pipeline, "SIGNATURE_SLICE", 2)  # several slices on a small corpus
    updates = record_updates(monkeypatch, pipeline)
    cfg = make_cfg(tmp_path)
    run_clean(StageContext(cfg, Workspace.from_config(cfg), tmp_path / "data"))
    err = capsys.readouterr().err
    n = step_docs_in(tmp_path / "data")["near_dedup"]
    assert n > 4
    for name in ("data near_dedup minhash", "data near_dedup lsh"):
        bar = final(err, name)
        assert (bar.percent, bar.n, bar.total, bar.unit) == (100, str(n), str(n), "doc")
    # The minhash bar moves a slice at a time, the LSH bar a document at a time; no filter bar beside them.
    assert updates["data near_dedup minhash"] == [2] * (n // 2) + ([n % 2] if n % 2 else [])
    assert updates["data near_dedup lsh"] == [1] * n
    assert "data near_dedup" not in bar_names(err)


def test_tokenize_and_pack_count_documents_and_tokens(tmp_path, capsys, monkeypatch):
    import stages.data.pack as pack

    cfg = make_cfg(tmp_path, val_fraction=0.15, num_proc=2)
    ws = Workspace.from_config(cfg)
    run_clean(StageContext(cfg, ws, tmp_path / "data"))
    run_tokenizer(StageContext(cfg, ws, tmp_path / "tok", inputs={"data": tmp_path / "data"}))
    capsys.readouterr()
    updates = record_updates(monkeypatch, pack)
    run_pack(StageContext(cfg, ws, tmp_path / "tokens", inputs={"data": tmp_path / "data", "tokenizer": tmp_path / "tok"}))
    err = capsys.readouterr().err
    splits = {r["split"]: r["documents"] for r in json.loads((tmp_path / "data" / "data_card.json").read_text())["splits"]}
    for split, folder in (("train", "train"), ("validation", "val")):
        bar = final(err, f"tokens tokenize {split}")
        assert (bar.percent, bar.n, bar.total, bar.unit) == (100, str(splits[split]), str(splits[split]), "doc")
        sizes = updates[f"tokens tokenize {split}"]
        assert sum(sizes) == splits[split]
        if split == "train":  # two workers, each reporting as its batches finish: the bar moved in pieces
            assert splits[split] >= 2 and len([n for n in sizes if n]) >= 2 and max(sizes) < splits[split]

        index = json.loads((tmp_path / "tokens" / folder / "index.json").read_text())
        packed = index["tokens"] + index["dropped_tokens"]  # every document's tokens and its EOS
        bar = final(err, f"tokens pack {split}")
        assert (bar.percent, bar.n, bar.total, bar.unit) == (100, tqdm.format_sizeof(packed), tqdm.format_sizeof(packed), "tok")
        assert sum(updates[f"tokens pack {split}"]) == packed and len(updates[f"tokens pack {split}"]) == index["documents"]

