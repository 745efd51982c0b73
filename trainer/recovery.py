"""What a training job does to survive faults, hooked into trainer.trainer.Trainer at four points:
`next_batch()` (skip data windows that caused spikes; injected poison), `before_update()` (the spike
verdict between the backward and the optimizer step, reduced over ranks), `after_step()` (heartbeat,
skip/rollback/diverged, periodic async checkpoints, injected kills and hangs) and `finish()` (the
final checkpoint, its URI for result.json). At construction it runs the pre-flight health check and,
when the job says `resume: latest`, restores the newest committed checkpoint of its output.

The trainer state a checkpoint carries besides weights and optimizer: step, the loader's global
sample position, the spike detector's history, the data windows skipped so far, the LR scale and the
rollback count; so a resumed or rolled-back job continues exactly where the checkpoint stood.
"""

from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.launch.base import endpoint_for
from infra.store import open_store

from .checkpoint import Checkpointer, checkpoint_key
from .faults import Faults, ScaledObjective
from .health import Heartbeat, preflight
from .spike import SpikeDetector, Verdict


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Recovery:
    def __init__(self, trainer):
        self.tr = trainer
        spec, t = trainer.spec, trainer.train_cfg
        self.cfg = t
        self.rank = trainer.rank
        self.store = open_store(spec.output, endpoint_url=endpoint_for(spec))
        workdir = Path(spec.workdir)  # this node's own (JobSpec.on_this_node): staging, heartbeats, faults
        if trainer.cfg.infra.health_check:
            report = preflight(trainer.device, workdir, self.store, self.rank)
            if self.rank == 0:
                log("trainer: pre-flight ok: " + "; ".join(f"{c.name}: {c.detail}" for c in report.checks))
        dims = trainer.dims
        layout = {"world_size": dims.world_size, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                  "pp": dims.pp, "cp": dims.cp, "tp": dims.tp, "ep": dims.ep, "zero": trainer.cfg.parallel.zero}
        self.faults = Faults(t.faults, self.rank, t.global_batch_size, workdir, job_attempt=spec.attempt)
        # rank 0, in the checkpoint's background thread: committed ones wait here for the training thread
        # to log them to MLflow (take_committed), then the fault drills get their turn
        self._committed: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self.ckpt = Checkpointer(self.store, t.checkpoint, workdir / "checkpoint-staging", layout,
                                 on_commit=self._on_commit)
        self.detector = SpikeDetector(t.spike)
        self.scaled: ScaledObjective | None = None
        f = self.faults.cfg
        if f.poison_step is not None or f.nan_step is not None:
            self.scaled = trainer.objective = ScaledObjective(trainer.objective)
        self.heartbeat = Heartbeat(workdir, self.rank)
        # set when this is a restart: torchrun's (same workdir, its heartbeat) or the task's (a new launch)
        self.last_seen = self.heartbeat.previous_last_seen() or spec.previous_attempt_ended_at
        self.skip_windows: list[list[int]] = []
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.skipped_steps = 0
        self.skips_in_row = 0
        self.streak_start: int | None = None
        self.step_sample = 0
        self.verdict = Verdict(False)
        self.message = ""
        self.figures: dict[str, float] = {}
        self.steps_this_attempt = 0
        self.resumed_from: int | None = None
        if spec.resume == "latest":
            manifest = self.ckpt.load_latest(trainer.model, trainer.optimizer)
            if manifest is not None:
                self._restore(manifest["trainer_state"])
                self.resumed_from = trainer.step
        # After a diverged attempt the task relaunches with a lower LR cap and the spiking data windows.
        self.lr_scale = min(self.lr_scale, spec.lr_scale)
        self.skip_windows = [list(w) for w in sorted({tuple(w) for w in self.skip_windows + spec.skip_windows})]

    def _on_commit(self, step: int) -> None:
        self._committed.put((step, self.store.url(checkpoint_key(step))))
        self.faults.after_commit(self.store, step)

    def take_committed(self) -> list[tuple[int, str]]:
        """The checkpoints (step, URI) rank 0 committed since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self._committed.get_nowait())
            except queue.Empty:
                return out

    # -- trainer state ------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        return {"step": self.tr.step, "loader": self.tr.loader.state_dict(), "spike": self.detector.state_dict(),
                "skip_windows": self.skip_windows, "lr_scale": self.lr_scale, "rollbacks": self.rollbacks,
                "skipped_steps": self.skipped_steps}

    def _restore(self, state: dict[str, Any], keep_windows: bool = False) -> None:
        self.tr.step = int(state["step"])
        self.tr.loader.load_state_dict(state["loader"])
        self.detector.load_state_dict(state["spike"])
        windows = [list(w) for w in state.get("skip_windows", [])]
        self.skip_windows = sorted({tuple(w) for w in windows + (self.skip_windows if keep_windows else [])})
        self.skip_windows = [list(w) for w in self.skip_windows]
        if not keep_windows:
            self.lr_scale = float(state.get("lr_scale", 1.0))
            self.rollbacks = int(state.get("rollbacks", 0))
            self.skipped_steps = int(state.get("skipped_steps", 0))

    # -- hooks --------------------------------------------------------------------------------------
    def next_batch(self):
        """This rank's micro-batches of the next step, jumping over skipped data windows."""
        loader = self.tr.loader
        moved = True
        while moved:
            moved = False
            for lo, hi in self.skip_windows:
                if lo <= loader.next_sample < hi:
                    loader.next_sample = hi
                    moved = True
        self.step_sample = loader.next_sample
        if self.scaled is not None:
            self.scaled.factor = self.faults.loss_factor(self.tr.step, loader.next_sample)
        return loader.next_step()

    def before_update(self, loss_sum: torch.Tensor, tokens: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Between backward and the optimizer step: apply the update (True) or skip it (False). The
        verdict is reduced over every rank so all of them take the same branch."""
        total = loss_sum.detach().float().reshape(1).clone()
        group = self.tr.dp_group
        if group is not None:
            dist.all_reduce(total, group=group)
        loss = float(total) / max(float(tokens), 1.0)
        verdict = self.detector.check(loss, float(grad_norm))
        flag = torch.tensor([1.0 if verdict.spike else 0.0], device=total.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            self.verdict = verdict if verdict.spike else Verdict(True, "another rank saw a spike")
            return False
        self.verdict = Verdict(False)
        self.detector.accept(loss, float(grad_norm))
        if self.lr_scale != 1.0:
            for g in self.tr.optimizer.param_groups:
                g["lr"] *= self.lr_scale
        return True

    def after_step(self, res, sink) -> str:
        """'ok', 'rolled_back' (the trainer's step and weights were reset) or 'diverged'."""
        step = self.tr.step
        self.steps_this_attempt += 1
        self.heartbeat.beat(step)
        if self.steps_this_attempt == 1 and self.last_seen is not None:
            # Failure to first new step: the previous attempt's last heartbeat is when it was last alive.
            self.figures["restart_s"] = time.time() - self.last_seen
            sink.log({"restart_s": self.figures["restart_s"], "resumed_from_step": float(self.resumed_from or 0)}, step)
            if self.rank == 0:
                log(f"trainer: first step {step} after restart, {self.figures['restart_s']:.2f}s after the last "
                    f"heartbeat of the previous attempt (resumed from step {self.resumed_from})")
        verdict = "ok"
        if not getattr(res, "applied", True):
            self.skipped_steps += 1
            self.skips_in_row += 1
            if self.streak_start is None:
                self.streak_start = self.step_sample
            sink.log({"spike_skipped": 1.0, "spike_loss": res.loss, "spike_grad_norm": res.grad_norm}, step)
            if self.rank == 0:
                log(f"trainer: spike at step {step}: {self.verdict.reason}; update skipped "
                    f"({self.skips_in_row} in a row)")
            if self.skips_in_row >= max(1, self.cfg.spike.max_skips):
                verdict = self.rollback(sink)
        else:
            self.skips_in_row, self.streak_start = 0, None
            every = self.cfg.checkpoint.every
            if every and step % every == 0 and step < self.cfg.steps:
                self.save()
        self.faults.after_step(step)
        return verdict

    def rollback(self, sink) -> str:
        """Back to the last good checkpoint, with the spiking data window skipped from now on."""
        window = [self.streak_start, self.tr.loader.next_sample]
        self.rollbacks += 1
        if self.rollbacks > self.cfg.spike.max_rollbacks:
            self.skip_windows.append(window)  # in result.json: the task's rollback skips it too
            self.message = (f"loss spikes at step {self.tr.step} after {self.rollbacks - 1} rollback(s) "
                            f"(max_rollbacks={self.cfg.spike.max_rollbacks}): {self.verdict.reason}")
            sink.log({"diverged": 1.0}, self.tr.step)
            return "diverged"
        at = self.tr.step
        self.skip_windows.append(window)
        rollbacks, skipped = self.rollbacks, self.skipped_steps
        manifest = self.ckpt.load_latest(self.tr.model, self.tr.optimizer)
        if manifest is not None:
            self._restore(manifest["trainer_state"], keep_windows=True)
        self.rollbacks, self.skipped_steps = rollbacks, skipped
        self.lr_scale *= self.cfg.spike.lr_factor_on_rollback
        self.skips_in_row, self.streak_start = 0, None
        sink.log({"spike_rollback": 1.0, "rollback_to_step": float(self.tr.step), "lr_scale": self.lr_scale}, at)
        if self.rank == 0:
            log(f"trainer: rollback {self.rollbacks} at step {at} to step {self.tr.step}; skipping samples "
                f"[{window[0]}, {window[1]}); lr scale {self.lr_scale:g}")
        return "rolled_back"

    def save(self, async_save: bool | None = None):
        return self.ckpt.save(self.tr.step, self.tr.model, self.tr.optimizer, self.trainer_state(), async_save)

    def finish(self, status: str) -> str | None:
        """The last checkpoint (synchronous) when training completed; the URI of the newest committed one."""
        self.ckpt.wait()
        if status == "completed" and self.tr.step > 0 and self.ckpt.last_step != self.tr.step:
            self.save(async_save=False)
        self.ckpt.wait()
        return self.ckpt.last_committed

    def metrics(self) -> dict[str, float]:
        out = dict(self.figures)
        out.update(spike_skipped_steps=float(self.skipped_steps), spike_rollbacks=float(self.rollbacks))
        saves = self.ckpt.history
        if saves:
            out["checkpoint_stall_s"] = max(s.stall_s for s in saves)
            out["checkpoint_save_s"] = max(s.total_s for s in saves)
        return out

    def close(self) -> None:
        self.ckpt.close()


def attempt_store(timeout) -> "dist.Store | None":
    """The rendezvous store for this restart attempt under torchrun, with the keys prefixed by the
    attempt number. torchrun restarts reuse the agent's store, and process groups of a new attempt
    would otherwise read the dead attempt's addresses ("Connection refused" in gloo's connectFullMesh).
    None outside torchrun (init_process_group's env:// then applies)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    is_master = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ.get("RANK") == "0"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=is_master,
                          timeout=timeout, world_size=int(os.environ["WORLD_SIZE"]) if is_master else None)
    return dist.PrefixStore(f"eightfold/attempt_{attempt}", store)
