"""Asynchronous checkpointing's stall (seed: "Asynchronous checkpointing copies to CPU memory first so
training resumes within seconds"): `save()` returns once the state sits in CPU memory, while the upload
is still blocked; the weights can change right after without touching what is saved; `wait()` then
commits and the checkpoint loads back equal to the weights at save time."""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from infra.config.train import CheckpointConfig
from infra.store import FileStore
from trainer.checkpoint import Checkpointer, committed_steps


class HeldUpload(FileStore):
    """A store whose uploads block until the test releases them (a slow object store, made
    deterministic: the test decides when the upload may finish instead of guessing a duration)."""

    def __init__(self, root):
        super().__init__(root)
        self.release = threading.Event()
        self.started = threading.Event()

    def put_file(self, *args, **kwargs):
        self.started.set()
        if not self.release.wait(timeout=30):
            raise TimeoutError("upload was never released")
        return super().put_file(*args, **kwargs)


def test_save_returns_after_staging_before_upload(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model[0].weight].items()}

    store = HeldUpload(tmp_path / "out")
    ck = Checkpointer(store, CheckpointConfig(async_save=True), tmp_path / "staging", {"world_size": 1})
    t0 = time.perf_counter()
    stats = ck.save(1, model, opt, {"step": 1})
    returned_s = time.perf_counter() - t0
    # save() came back while the upload cannot have finished: nothing is committed yet.
    assert store.started.wait(timeout=10), "the background thread never reached the upload"
    assert ck._pending is not None and ck._pending.is_alive()
    assert committed_steps(store) == []
    assert stats.stall_s <= returned_s < 5.0

    # Training goes on at once: weights and optimizer state change in place while the upload is held.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    assert not torch.equal(model[0].weight, at_save["0.weight"])

    held_s = 0.3
    time.sleep(held_s)
    store.release.set()
    t1 = time.perf_counter()
    ck.wait()
    assert time.perf_counter() - t1 < 10
    assert committed_steps(store) == [1]
    assert ck.history[0].total_s >= held_s > stats.stall_s  # the upload outlasted the stall

    # The checkpoint holds the values at save time, not the ones written after save() returned.
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    manifest = Checkpointer(store, CheckpointConfig(), tmp_path / "load", {"world_size": 1}).load_latest(fresh,
                                                                                                         fresh_opt)
    assert manifest["step"] == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_save[k]), k
    for k, v in fresh_opt.state[fresh[0].weight].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(moments[k])), k
    ck.close()
