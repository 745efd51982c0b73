"""Progress bars of the data and tokens stages on a small slice of the standard library: each datatrove
stage of the cleaning pipeline counts its tasks; tokenization counts documents as the worker pool finishes
batches, packing counts the tokens the shards' index records.
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


def test_every_pipeline_stage_counts_its_tasks(tmp_path, capsys):
    """Each datatrove stage draws one bar of its tasks (filter and write: one per shard; buckets: one per LSH
    band; clusters: one), in stage order, each reaching the task count the card records."""
    cfg = make_cfg(tmp_path, workers=1, task_mb=0.05)
    summary = run_clean(StageContext(cfg, Workspace.from_config(cfg), tmp_path / "data"))
    err = capsys.readouterr().err
    near = json.loads((tmp_path / "data" / "data_card.json").read_text())["near_dedup"]
    expected = {"data filter": summary["tasks"], "data buckets": near["bands"], "data clusters": 1,
                "data write": summary["tasks"]}
    assert summary["tasks"] >= 2
    for name, total in expected.items():
        bar = final(err, name)
        assert (bar.percent, bar.n, bar.total, bar.unit) == (100, str(total), str(total), "task")
    assert [n for n in bar_names(err) if n.startswith("data ")] == list(expected)


def test_tokenize_and_pack_count_documents_and_tokens(tmp_path, capsys, monkeypatch):
    import stages.data.pack as pack

    cfg = make_cfg(tmp_path, val_fraction=0.15, num_proc=2, workers=1)
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

