"""Nothing in a checkpoint is unpickled into objects: whoever can write the bucket must not run code on
the nodes that load it. A planted pickle whose __reduce__ would create a marker file, put in a committed
checkpoint as a rank's RNG file, as DCP's .metadata, or as a non-tensor entry (the optimizer's lr,
keyed by parameter as every optimizer's state is, ZeRO-1's included) inside DCP's shard, with the
manifest's size and sha256 updated so the checkpoint still verifies, is refused with an error naming
the file, and the marker never appears.
The RNG states stored as tensors still restore every stream exactly."""

from __future__ import annotations

import io
import pathlib
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from infra.config.train import CheckpointConfig
from infra.store import FileStore, join_key, sha256_file
from trainer.checkpoint import Checkpointer, fetch_verified, read_manifest, step_dir
from trainer.safe_load import RefusedFile, load_plain


class Plant:
    """Unpickling this calls Path.touch(marker): code chosen by whoever wrote the file."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)


def save_one(tmp_path, optimizer_factory) -> FileStore:
    store = FileStore(tmp_path / "out")
    torch.manual_seed(0)
    model = Tiny()
    ck = Checkpointer(store, CheckpointConfig(), tmp_path / "staging", {"world_size": 1})
    ck.save(1, model, optimizer_factory(model), {"step": 1}, async_save=False)
    return store


def resign(store: FileStore, rel: str) -> None:
    """Update the manifest's size and sha256 of `rel`, as a bucket writer could."""
    key = join_key("checkpoints", step_dir(1))
    path = store.local_path(key) / rel
    manifest = read_manifest(store, 1).manifest
    manifest["files"][rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    store.put_json(manifest, join_key(key, "manifest.json"))


def plant(store: FileStore, rel: str, marker: pathlib.Path) -> pathlib.Path:
    """Put the malicious pickle where `rel` is read; returns the file holding it."""
    folder = store.local_path(join_key("checkpoints", step_dir(1)))
    if rel == ".metadata":  # DCP's metadata is a bare pickle
        (folder / rel).write_bytes(pickle.dumps(Plant(marker)))
        resign(store, rel)
        return folder / rel
    if rel == LR:  # a non-tensor entry of DCP's shard: append it, repoint the metadata
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import MetadataIndex

        meta = FileSystemReader(str(folder)).read_metadata()  # the test trusts its own checkpoint
        info = meta.storage_data[MetadataIndex(rel)]
        shard = folder / info.relative_path
        buf = io.BytesIO()
        torch.save(Plant(marker), buf)
        info.offset, info.length = shard.stat().st_size, len(buf.getvalue())
        with open(shard, "ab") as f:
            f.write(buf.getvalue())
        meta.storage_meta = None
        (folder / ".metadata").write_bytes(pickle.dumps(meta))
        resign(store, info.relative_path)
        resign(store, ".metadata")
        planted = folder.parent / "planted.pt"
        planted.write_bytes(buf.getvalue())
        return planted
    torch.save(Plant(marker), folder / rel)
    resign(store, rel)
    return folder / rel


LR = "optim.param_groups.a.weight.lr"  # optimizer state is flattened per parameter (trainer.checkpoint)
OPTIMIZERS = {"rng/rank0.pt": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
              ".metadata": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
              LR: lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)}
NAMED = {LR: f"refused to load entry '{LR}'"}  # else the file


@pytest.mark.parametrize("rel", sorted(OPTIMIZERS))
def test_planted_pickle_is_refused_and_never_runs(tmp_path, rel):
    store = save_one(tmp_path, OPTIMIZERS[rel])
    marker = tmp_path / "marker"
    path = plant(store, rel, marker)
    fetch_verified(store, read_manifest(store, 1), tmp_path / "unused")  # the checkpoint still verifies

    fresh = Tiny()
    ck = Checkpointer(store, CheckpointConfig(), tmp_path / "load", {"world_size": 1})
    expected = NAMED.get(rel, f"checkpoints/{step_dir(1)}/{rel}: refused to load")
    with pytest.raises(RefusedFile, match=expected.replace(".", r"\.")) as err:
        ck.load_latest(fresh, OPTIMIZERS[rel](fresh))
    assert "Unsupported global" in str(err.value) or "pathlib.Path.touch" in str(err.value) or \
        "builtins.getattr" in str(err.value), err.value  # says what was refused
    assert not marker.exists()

    # The payload is real: a full unpickle (what loading did before) runs it.
    if rel == ".metadata":
        pickle.loads(path.read_bytes())
    else:
        torch.load(path, weights_only=False)
    assert marker.exists()


def draws() -> list[float]:
    """Values from every stream a rank draws from, gaussian caches included."""
    return ([random.random() for _ in range(3)] + [random.gauss(0, 1) for _ in range(3)]
            + np.random.rand(3).tolist() + np.random.standard_normal(3).tolist()
            + torch.rand(3).tolist() + torch.randn(3).tolist())


def test_restored_rng_streams_continue_identically(tmp_path):
    store = FileStore(tmp_path / "out")
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave a gaussian cached in python's and numpy's state
    Checkpointer(store, CheckpointConfig(), tmp_path / "st", {"world_size": 1}).save(1, model, opt, {"step": 1},
                                                                                   async_save=False)
    expected = draws()

    random.seed(7), np.random.seed(8), torch.manual_seed(9)
    assert draws() != expected
    Checkpointer(store, CheckpointConfig(), tmp_path / "ld", {"world_size": 1}).load_latest(model, opt)
    assert draws() == expected  # exactly: every stream continues where it was saved

    # The file holds tensors and plain values only, the cached gaussians among them.
    state = load_plain(store.local_path(join_key("checkpoints", step_dir(1))) / "rng" / "rank0.pt", "rng")
    assert state["numpy"]["has_gauss"] == 1 and isinstance(state["python"]["gauss_next"], float)

    def plain(x) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return all(plain(v) for v in x)
        return isinstance(x, (torch.Tensor, int, float, str, type(None)))

    assert plain(state)
