"""Fault injection for tests and drills (off unless `pretrain.faults` or EIGHTFOLD_FAULTS asks): a rank
killed with SIGKILL or hung (SIGSTOP, or asleep before a collective) after step S, a rank made
slower (a straggler: a sleep after every forward), a NaN loss at step S, a poisoned data window whose
loss is multiplied (a loss spike), a checkpoint shard truncated or flipped or its manifest removed
after commit, and S3 errors (500/503, dropped connections) injected into a boto3 client through
botocore's event hooks.

Faults fire only on restart attempt `attempt` (torchrun's TORCHELASTIC_RESTART_COUNT) of launch
`job_attempt` (the task's retries relaunch the job), so the restarted job shows what recovery does
rather than failing the same way again.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from infra.config.faults import FaultsConfig
from infra.store import FileStore, Store, join_key

ENV = "EIGHTFOLD_FAULTS"


def restart_attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Faults:
    def __init__(self, cfg: FaultsConfig, rank: int, global_batch_size: int, workdir: str | Path | None = None,
                 job_attempt: int = 0):
        if os.environ.get(ENV):
            cfg = FaultsConfig.model_validate({**cfg.model_dump(), **json.loads(os.environ[ENV])})
        self.cfg, self.rank, self.global_batch_size = cfg, rank, global_batch_size
        # torchrun's restart count within one launch, and which launch of the job this is (a task retry)
        self.armed = restart_attempt() == cfg.attempt and job_attempt == cfg.job_attempt
        self.workdir = Path(workdir) if workdir else None

    def _say(self, what: str) -> None:
        print(f"faults: rank {self.rank} {what} (attempt {restart_attempt()})", file=sys.stderr, flush=True)

    def after_step(self, step: int) -> None:
        """Called by every rank after completing `step` steps."""
        c = self.cfg
        if not self.armed:
            return
        if c.kill_rank == self.rank and c.kill_step == step:
            self._say(f"SIGKILLs itself after step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if c.hang_rank == self.rank and c.hang_step == step:
            self._say(f"hangs after step {step} ({c.hang_mode})")
            if c.hang_mode == "shutdown":  # the job goes on and ends; the process never exits
                atexit.register(_block_holding_the_gil)
            elif c.hang_mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                while True:  # the peers' next collective times out
                    time.sleep(3600)

    def slow_down(self, model) -> None:
        """Make this rank a straggler when `slow_rank` names it: a sleep after every forward of the root
        module, inside the forward-to-backward window trainer/stragglers.py times (a slower device)."""
        c = self.cfg
        if not self.armed or c.slow_rank != self.rank:
            return
        self._say(f"is a straggler: sleeps {c.slow_s}s after each forward")
        model.register_forward_hook(lambda module, args, output: time.sleep(c.slow_s))

    def loss_factor(self, step: int, sample_start: int) -> float | None:
        """Multiplier for the loss of the step starting at global sample `sample_start`, or None.
        The poison window is in global samples (original data order), so after a rollback that skips
        it the same data is never seen again; a NaN hits one step index on the armed attempt."""
        c = self.cfg
        if c.nan_step is not None and self.armed and step == c.nan_step:
            return float("nan")
        if c.poison_step is not None:
            lo = c.poison_step * self.global_batch_size
            hi = lo + c.poison_steps * self.global_batch_size
            if lo <= sample_start < hi:
                return c.poison_factor
        return None

    def after_commit(self, store: Store, step: int) -> None:
        c = self.cfg
        if self.armed and self.rank == 0 and c.corrupt_checkpoint_step == step:
            self._say(f"damages checkpoint step {step} ({c.corrupt_mode})")
            damage_checkpoint(store, step, c.corrupt_mode)


def _block_holding_the_gil() -> None:
    """libc's pause() called through PyDLL, which keeps the GIL: no Python thread (no watchdog) runs
    again, as in a library's destructor stuck in C. Only a signal ends the process."""
    import ctypes

    ctypes.PyDLL(None).pause()


class ScaledObjective:
    """Wraps the training objective; multiplies a micro-batch's summed loss by `factor` while set (so
    the logged loss and the gradients both spike, as a bad batch would make them)."""

    def __init__(self, inner):
        self.inner = inner
        self.factor: float | None = None

    def weight(self, batch):
        return self.inner.weight(batch)

    def loss(self, model, batch, device):
        out = self.inner.loss(model, batch, device)
        if self.factor is None:
            return out
        out.ce_sum = out.ce_sum * self.factor
        return out


# --- checkpoint damage -----------------------------------------------------------------------------
def damage_checkpoint(store: Store, step: int, mode: str) -> str:
    """Truncate or flip a byte of the first shard of checkpoint `step`, or delete its manifest.
    Returns the key damaged. Works on any store (download, damage, upload)."""
    from .checkpoint import MANIFEST, ROOT, step_dir

    folder = join_key(ROOT, step_dir(step))
    if mode == "drop_manifest":
        store.delete(join_key(folder, MANIFEST))
        return join_key(folder, MANIFEST)
    shards = [k for k in store.list(folder) if k.rsplit("/", 1)[-1].startswith("__") and k.endswith(".distcp")]
    if not shards:
        raise FileNotFoundError(f"{store.url(folder)} holds no .distcp shard to damage")
    key = shards[0]
    data = bytearray(store.get_bytes(key))
    if mode == "truncate":
        data = data[: len(data) // 2]
    elif mode == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        raise ValueError(f"damage mode {mode!r}: truncate, flip or drop_manifest")
    if isinstance(store, FileStore):  # keep the same file (no metadata to fake)
        store.local_path(key).write_bytes(bytes(data))
    else:
        store.put_bytes(bytes(data), key)
    return key


# --- S3 errors through botocore hooks --------------------------------------------------------------
def inject_s3_errors(client, plan: Callable[[str, int], int | str | None]) -> list[tuple[str, int | str]]:
    """Make a boto3 S3 client fail the requests `plan(operation, n)` picks: an HTTP status (500, 503)
    is answered with an S3 error body, "drop" raises a closed connection. Returns the log of
    (operation, outcome). Uses the `before-send` event: the request never leaves the process."""
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ConnectionClosedError

    log: list[tuple[str, int | str]] = []

    class _Raw:
        def __init__(self, body: bytes):
            self._body = body

        def stream(self, **_):
            yield self._body

    def before_send(request, **kwargs):
        op = kwargs.get("event_name", "").rsplit(".", 1)[-1]
        n = len(log) + 1
        fault = plan(op, n)
        log.append((op, fault or "ok"))
        if fault == "drop":
            raise ConnectionClosedError(endpoint_url=request.url)
        if fault:
            code = {500: "InternalError", 503: "ServiceUnavailable"}.get(int(fault), "Injected")
            body = f"<Error><Code>{code}</Code><Message>injected {fault}</Message></Error>".encode()
            return AWSResponse(request.url, int(fault), {"Content-Type": "application/xml"}, _Raw(body))
        return None

    client.meta.events.register("before-send.s3", before_send)
    return log


def poisoned(tensor: torch.Tensor) -> bool:
    return not bool(torch.isfinite(tensor).all())
