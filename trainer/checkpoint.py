"""Sharded, asynchronous checkpoints in the object store, committed by a manifest (seed: "each rank
writes its own shard of weights, optimizer state, data-loader position and random-number state, all in
parallel, to distributed storage. Asynchronous checkpointing copies to CPU memory first so training
resumes within seconds").

Layout under the job's output (any `infra.store` backend):

    checkpoints/step_00000040/.metadata            DCP's global plan (rank 0)
    checkpoints/step_00000040/__R_0.distcp         rank R's shard of model + optimizer (DCP)
    checkpoints/step_00000040/rng/rankR.pt         rank R's RNG states (torch, cuda, numpy, python)
    checkpoints/step_00000040/manifest.json        written LAST: files with size and sha256, step,
                                                   layout (mesh), trainer state (loader position ...)

A save: (1) `dcp.async_save` copies the state dict to CPU memory (the only part the training loop
waits for) and writes this rank's shard to a local staging folder in a background thread over a
dedicated gloo group, so its collectives never interleave with training's; (2) the same background
thread uploads the rank's files to the store, (3) gathers every rank's file list on the checkpoint
group, and (4) rank 0 writes manifest.json and prunes old checkpoints. A folder without a manifest,
or whose files do not match it (size, sha256), is never loaded: `load_latest` falls back to the
previous committed checkpoint. Resharding: DCP stores tensors by fully-qualified name with global
offsets, so a checkpoint saved on one mesh loads onto another; the loader position is a global
sample index (trainer.data), so it carries over too. Optimizer state is in DSD's flattened shape
("optim.state.{fqn}.exp_avg", "optim.param_groups.{fqn}.lr"), whichever optimizer wrote it: ZeRO-1's
moments (and fp32 masters, where they are copies) are sharded tensors of the parameters' global
shapes (trainer.parallel.zero1_state), so plain and ZeRO-1 checkpoints load into each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch import nn

from infra.config.train import CheckpointConfig
from infra.store import ChecksumMismatch, FileStore, Store, StoreError, join_key, sha256_file

from .parallel.mesh import new_group
from .safe_load import MetadataReader, load_dcp, load_plain

ROOT = "checkpoints"
MANIFEST = "manifest.json"
# 2: optimizer state flattened per parameter (_state_dict_options); RNG states as tensors, loaded weights-only
FORMAT = "eightfold-dcp-2"
_REFUSED_HINT = f"tampered with, or written before checkpoint format {FORMAT}"



@contextlib.contextmanager
def _one_process_ok():
    """One process saving or loading is intended here (single-rank jobs, tests), and ZeRO-1's moments are
    ShardedTensors on purpose (arbitrary chunks per rank, which DTensor cannot express): quiet DCP's
    warnings about both."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
        yield


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_key(step: int) -> str:
    """The checkpoint's folder under the job's output, as a store key."""
    return join_key(ROOT, step_dir(step))


def parse_step(name: str) -> int | None:
    if not name.startswith("step_"):
        return None
    try:
        return int(name[5:])
    except ValueError:
        return None


# --- what goes into a checkpoint -------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every random-number generator a rank draws from, so a resumed rank continues the same streams.
    Tensors and plain Python values only (numpy's and Python's states taken apart into them), so the
    file loads with torch.load(weights_only=True): nothing in it is unpickled into an object."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},  # None or a float
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n, p = state["numpy"], state["python"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate((p["version"], tuple(p["internal"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _uses_own_state_dict(optimizer) -> bool:
    """Distributed optimizers of trainer.parallel (ZeRO-1) give state_dict() in DSD's flattened shape
    themselves (`fqn_state_dict = True`); torch optimizers go through DSD."""
    return bool(getattr(optimizer, "fqn_state_dict", False)) or not isinstance(optimizer, torch.optim.Optimizer)


def _state_dict_options():
    """Optimizer state flattened to one key per parameter (`state.{fqn}.exp_avg`, `param_groups.{fqn}.lr`):
    nested, DCP would key param groups by their index, and pipeline stages, whose groups hold different
    parameters under the same index, would overwrite each other's (a resumed stage then found no group for
    its parameters and AdamW failed with KeyError 'betas')."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def model_and_optim_state(model: nn.Module, optimizer, masters: bool = True) -> dict[str, Any]:
    """{"model": ..., "optim": ...} keyed by fully-qualified parameter names; DTensor (FSDP/TP) shards
    stay sharded (torch.distributed.checkpoint.state_dict handles the wrappers), and ZeRO-1's moments
    and masters are sharded tensors of the parameters' global shapes. `masters=False`: without
    ZeRO-1's masters (loading a checkpoint that has none)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    state = {"model": get_model_state_dict(inner)}
    if _uses_own_state_dict(optimizer):
        state["optim"] = optimizer.state_dict(masters=masters)
    else:
        state["optim"] = get_optimizer_state_dict(inner, optimizer, options=_state_dict_options())
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def apply_model_and_optim_state(model: nn.Module, optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    set_model_state_dict(inner, state["model"])
    if _uses_own_state_dict(optimizer):
        optimizer.load_state_dict(state["optim"])
    else:
        set_optimizer_state_dict(inner, optimizer, state["optim"], options=_state_dict_options())


class CachedStager(AsyncStager):
    """Stages a state dict to CPU memory allocated at the first save and reused by every later one.
    torch's DefaultStager copies storages by deep-copy and cannot take a ShardedTensor (ZeRO-1's moments);
    this is torch's BlockingAsyncStager with its cache, except that it pins only where there is CUDA
    (BlockingAsyncStager always pins, which fails on a CPU-only machine)."""

    _synchronize_after_execute = False

    def __init__(self, pin: bool):
        self.pin = pin
        self.cache: dict[str, Any] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self.cache is None:
            self.cache = _create_cpu_state_dict(state_dict, pin_memory=self.pin)
        staged = _copy_state_dict(state_dict, self.cache, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the copies have landed before training touches the sources again
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.cache = None


# --- committed checkpoints in a store --------------------------------------------------------------
@dataclass
class Committed:
    step: int
    key: str  # folder key in the store
    manifest: dict[str, Any]


def committed_steps(store: Store) -> list[int]:
    """Steps whose folder holds a manifest, newest first (a folder without one does not exist)."""
    steps = []
    for name in store.iter_dirs(ROOT):
        step = parse_step(name)
        if step is not None and store.exists(join_key(ROOT, name, MANIFEST)):
            steps.append(step)
    return sorted(steps, reverse=True)


def read_manifest(store: Store, step: int) -> Committed:
    key = join_key(ROOT, step_dir(step))
    return Committed(step, key, store.get_json(join_key(key, MANIFEST)))


def fetch_verified(store: Store, ckpt: Committed, local: Path) -> Path:
    """The checkpoint's files in a local folder, every one checked against the manifest's size and
    sha256 (a file store is checked in place, no copy). Raises ChecksumMismatch / FileNotFoundError."""
    files = ckpt.manifest.get("files") or {}
    if not files:
        raise ChecksumMismatch(f"{store.url(ckpt.key)}: manifest lists no files")
    if isinstance(store, FileStore):
        local = store.local_path(ckpt.key)
        for rel, meta in files.items():
            path = local / rel
            if not path.is_file():
                raise FileNotFoundError(f"{store.url(join_key(ckpt.key, rel))} is missing")
            if path.stat().st_size != meta["size"]:
                raise ChecksumMismatch(f"{store.url(join_key(ckpt.key, rel))}: {path.stat().st_size} bytes, "
                                       f"the manifest says {meta['size']} (truncated?)")
            if sha256_file(path) != meta["sha256"]:
                raise ChecksumMismatch(f"{store.url(join_key(ckpt.key, rel))}: sha256 differs from the manifest")
        return local
    shutil.rmtree(local, ignore_errors=True)
    for rel, meta in files.items():
        path = store.get_file(join_key(ckpt.key, rel), local / rel, sha256=meta["sha256"])
        if path.stat().st_size != meta["size"]:
            raise ChecksumMismatch(f"{store.url(join_key(ckpt.key, rel))}: size differs from the manifest")
    return local


def prune(store: Store, keep_last: int, keep_every: int, log: Callable[[str], None] = print) -> list[int]:
    """Keep the newest `keep_last` committed checkpoints plus every step divisible by `keep_every`;
    delete the rest (manifest first, so a half-deleted folder is never taken for a checkpoint).
    Uncommitted folders older than the newest commit are leftovers of a failed save: deleted too."""
    steps = committed_steps(store)
    keep = set(steps[:keep_last]) | {s for s in steps if keep_every and s % keep_every == 0}
    gone = []
    for s in steps:
        if s not in keep:
            key = join_key(ROOT, step_dir(s))
            store.delete(join_key(key, MANIFEST))
            store.delete(key)
            gone.append(s)
    newest = steps[0] if steps else None
    for name in list(store.iter_dirs(ROOT)):
        s = parse_step(name)
        if s is not None and newest is not None and s < newest and s not in steps:
            store.delete(join_key(ROOT, name))
    if gone:
        log(f"checkpoint: pruned steps {sorted(gone)} (keep_last={keep_last}, keep_every={keep_every})")
    return gone


def uncommit(store: Store, step: int) -> None:
    """Delete one committed checkpoint, manifest first (a half-deleted folder is never taken for one):
    the task's rollback after a diverged job drops the checkpoint the job kept rolling back to."""
    key = join_key(ROOT, step_dir(step))
    store.delete(join_key(key, MANIFEST))
    store.delete(key)


def drop_uncommitted(store: Store, prefix: str = "") -> list[str]:
    """Delete every checkpoint folder under `prefix` (at any depth) that holds no manifest: what a job
    killed half way through a save left. Returns the folders deleted."""
    folders: dict[str, bool] = {}
    for key in store.list(prefix):
        parts = key.split("/")
        for i in range(len(parts) - 2):
            if parts[i] == ROOT and parse_step(parts[i + 1]) is not None:
                folder = "/".join(parts[: i + 2])
                folders[folder] = folders.get(folder, False) or parts[i + 2:] == [MANIFEST]
                break
    gone = [f for f, committed in sorted(folders.items()) if not committed]
    for folder in gone:
        store.delete(folder)
    return gone


# --- the checkpointer ------------------------------------------------------------------------------
@dataclass
class SaveStats:
    step: int
    stall_s: float  # time the training loop was held (staging to CPU, or the whole save when sync)
    total_s: float = 0.0  # staging + write + upload + commit
    uri: str = ""


class Checkpointer:
    """One per rank. `save()` starts a checkpoint (returns after staging when async); `wait()` blocks
    until the pending one is committed; `load_latest()` restores the newest checkpoint that verifies."""

    def __init__(self, store: Store, cfg: CheckpointConfig, staging_dir: str | Path, layout: dict[str, Any],
                 log: Callable[[str], None] | None = None, on_commit: Callable[[int], None] | None = None):
        self.store, self.cfg, self.layout = store, cfg, layout
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Checkpoint collectives run in a background thread; on their own gloo group they can never
        # interleave with the training loop's collectives on the default group.
        self.group = new_group(backend="gloo") if self.world > 1 else None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.staging = Path(staging_dir) / f"attempt-{attempt}-{os.getpid() if self.world == 1 else 'job'}"
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._pending: threading.Thread | None = None
        self._stager = None  # CPU staging buffers, kept across saves (see _staging)
        self._error: BaseException | None = None
        self.on_commit = on_commit  # rank 0, after the manifest is written (fault drills use it)
        self.last_committed: str | None = None
        self.last_step: int | None = None  # step of last_committed
        self.last_stats: SaveStats | None = None
        self.history: list[SaveStats] = []

    # -- saving -------------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer, trainer_state: dict[str, Any],
             async_save: bool | None = None) -> SaveStats:
        """Checkpoint `step`. Every rank calls it at the same step. Async: returns once the state sits
        in CPU memory; the write, upload and commit finish in the background."""
        async_save = self.cfg.async_save if async_save is None else async_save
        self.wait()  # one checkpoint in flight at a time (and its error surfaces here)
        t0 = time.perf_counter()
        local = self.staging / step_dir(step)
        if self.rank == 0:
            shutil.rmtree(local, ignore_errors=True)
        self._barrier()
        (local / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), local / "rng" / f"rank{self.rank}.pt")
        state = model_and_optim_state(model, optimizer)
        stats = SaveStats(step=step, stall_s=0.0)
        future = None
        with _one_process_ok():
            if async_save:
                future = dcp.async_save(state, checkpoint_id=str(local), process_group=self.group,
                                        async_stager=self._staging())
            else:
                dcp.save(state, checkpoint_id=str(local), process_group=self.group)
        if async_save:
            stats.stall_s = time.perf_counter() - t0
            self._pending = threading.Thread(target=self._finish_guarded, name=f"checkpoint-{step}",
                                             args=(future, step, local, trainer_state, stats, t0), daemon=True)
            self._pending.start()
        else:
            self._finish(None, step, local, trainer_state, stats, t0)
            stats.stall_s = stats.total_s
        return stats

    def _staging(self):
        """One stager for the job: its CPU copies (pinned on CUDA) are allocated at the first save and
        reused by every later one, so a save's stall is one device-to-host copy, not an allocation.
        Safe because a save starts only after the previous one finished reading them."""
        if self._stager is None:
            self._stager = CachedStager(pin=torch.cuda.is_available() and torch.cuda.is_initialized())
        return self._stager

    def _finish_guarded(self, *args) -> None:
        try:
            self._finish(*args)
        except BaseException as exc:  # surfaced by the next wait()/save() on the training thread
            self._error = exc

    def _finish(self, future: Future | None, step: int, local: Path, trainer_state: dict, stats: SaveStats,
                t0: float) -> None:
        if future is not None:
            future.result()
        key = checkpoint_key(step)
        mine = self._my_files(local)
        files = {}
        for rel in mine:
            path = local / rel
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            self.store.put_file(path, join_key(key, rel))  # S3Store retries transient errors with backoff
        if self.group is not None:  # every rank's files have arrived before anyone commits
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, files, group=self.group)
            files = {k: v for part in gathered for k, v in part.items()}
        if self.rank == 0:
            manifest = {
                "format": FORMAT, "step": step, "world_size": self.world, "layout": self.layout,
                "files": dict(sorted(files.items())), "trainer_state": trainer_state,
                "created_at": time.time(),
            }
            self.store.put_json(manifest, join_key(key, MANIFEST))
            prune(self.store, self.cfg.keep_last, self.cfg.keep_every, self.log)
            if self.on_commit is not None:
                self.on_commit(step)
        self._remove_mine(local, mine)
        stats.total_s = time.perf_counter() - t0
        stats.uri = self.store.url(key)
        self.last_committed, self.last_step = stats.uri, step
        self.last_stats = stats
        self.history.append(stats)
        if self.rank == 0:
            self.log(f"checkpoint: committed step {step} at {stats.uri} ({len(files)} files, {stats.total_s:.2f}s)")

    def _my_files(self, local: Path) -> list[str]:
        """The files this rank wrote: its DCP shards (`__R_*`), its RNG file, and rank 0's .metadata."""
        names = [p.name for p in local.iterdir() if p.is_file() and p.name.startswith(f"__{self.rank}_")]
        if self.rank == 0:
            names.append(".metadata")
        names.append(f"rng/rank{self.rank}.pt")
        return sorted(names)

    def _remove_mine(self, local: Path, mine: list[str]) -> None:
        for rel in mine:
            (local / rel).unlink(missing_ok=True)

    def wait(self) -> None:
        """Block until the checkpoint in flight is committed; re-raise its error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkpoint save failed: {type(err).__name__}: {err}") from err

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # -- loading ------------------------------------------------------------------------------------
    def load_latest(self, model: nn.Module, optimizer, before: int | None = None) -> dict[str, Any] | None:
        """Restore the newest committed checkpoint that verifies (strictly before step `before` when
        given) into model and optimizer, and this rank's RNG states when the world size matches.
        Returns the manifest (its `trainer_state` holds step, loader position ...), or None."""
        self.wait()
        candidates = [s for s in committed_steps(self.store) if before is None or s < before]
        chosen, folder = None, None
        for step in candidates:
            try:
                ckpt = read_manifest(self.store, step)
                folder = fetch_verified(self.store, ckpt, self._load_dir(step))
                chosen = ckpt
                break
            except (ChecksumMismatch, FileNotFoundError, StoreError, json.JSONDecodeError, KeyError) as exc:
                self.log(f"checkpoint: step {step} is not usable ({type(exc).__name__}: {exc}); trying the previous one")
        chosen, folder = self._agree(chosen, folder)
        if chosen is None:
            return None
        uri = self.store.url(chosen.key)
        saved = MetadataReader(folder, uri).read_metadata().state_dict_metadata
        has_masters = any(k.startswith("optim.state.") and k.endswith(".master") for k in saved)
        state = model_and_optim_state(model, optimizer, masters=has_masters)
        with _one_process_ok():  # nothing stored is unpickled into objects (trainer.safe_load)
            load_dcp(state, folder, uri, process_group=self.group)
            if getattr(optimizer, "own_masters", False) and not has_masters:
                # Saved from fp32 weights (a plain fp32 optimizer's): ZeRO-1's fp32 masters of non-fp32
                # parameters come from the checkpoint's weights, read at full precision.
                masters = {"model": optimizer.master_state_dict()}
                load_dcp(masters, folder, uri, process_group=self.group)
        apply_model_and_optim_state(model, optimizer, state)
        rng = folder / "rng" / f"rank{self.rank}.pt"
        if chosen.manifest.get("world_size") == self.world and rng.is_file():
            set_rng_state(load_plain(rng, f"{uri}/rng/{rng.name}", _REFUSED_HINT))
        self.last_committed, self.last_step = self.store.url(chosen.key), chosen.step
        if self.rank == 0:
            saved = chosen.manifest.get("layout", {})
            self.log(f"checkpoint: resumed from step {chosen.step} ({self.last_committed}; saved on "
                     f"{chosen.manifest.get('world_size')} rank(s) {saved}, loading on {self.world})")
        return chosen.manifest

    def _load_dir(self, step: int) -> Path:
        return self.staging.parent / f"load-rank{self.rank}" / step_dir(step)

    def _agree(self, chosen: Committed | None, folder: Path | None) -> tuple[Committed | None, Path | None]:
        """Every rank must load the same step: take the oldest of the ranks' choices (a rank that could
        not verify a newer one forces everyone back) and verify it here if this rank chose newer."""
        if self.group is None:
            return chosen, folder
        mine = torch.tensor([chosen.step if chosen else -1], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.group)
        step = int(mine)
        if step < 0:
            return None, None
        if chosen is None or chosen.step != step:
            chosen = read_manifest(self.store, step)
            folder = fetch_verified(self.store, chosen, self._load_dir(step))
        return chosen, folder

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def latest_uri(store: Store) -> str | None:
    """URI of the newest committed checkpoint in a job output store (without verifying its files)."""
    steps = committed_steps(store)
    return store.url(join_key(ROOT, step_dir(steps[0]))) if steps else None


def staged_bytes(state: dict[str, Any]) -> int:
    """Bytes of tensors in a (nested) state dict: what a save copies to CPU memory."""
    total = 0
    for v in state.values():
        if isinstance(v, dict):
            total += staged_bytes(v)
        elif hasattr(v, "local_shards"):  # a ShardedTensor (ZeRO-1): this rank's shards
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


__all__ = ["Checkpointer", "Committed", "committed_steps", "fetch_verified", "latest_uri", "prune",
           "read_manifest", "rng_state", "set_rng_state", "step_dir"]
