"""`pretrain.faults:` fault injection for tests and drills. Everything is off by default; a fault fires
only on the restart attempt `attempt` (torchrun's TORCHELASTIC_RESTART_COUNT, 0 = the first run), so a
restarted job runs clean. The env var EIGHTFOLD_FAULTS (JSON with these fields) overrides the config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class FaultsConfig(Section):
    attempt: int = Field(0, ge=0, description="restart attempt on which faults fire (0 = first run)")
    job_attempt: int = Field(0, ge=0, description="launch of the job on which faults fire (task retries relaunch it)")
    kill_rank: int | None = Field(None, ge=0, description="this rank SIGKILLs itself ...")
    kill_step: int | None = Field(None, ge=1, description="... after completing this many steps")
    hang_rank: int | None = Field(None, ge=0, description="this rank hangs ...")
    hang_step: int | None = Field(None, ge=1, description="... after completing this many steps")
    hang_mode: Literal["stop", "sleep", "shutdown"] = Field(
        "stop", description="SIGSTOP itself, sleep before the next collective, or finish the job and then never exit "
        "(blocked in C at interpreter exit, holding the GIL)")
    slow_rank: int | None = Field(None, ge=0, description="this rank is a straggler: sleeps after each forward")
    slow_s: float = Field(0.1, gt=0, description="seconds the slow rank sleeps after each forward of the model")
    nan_step: int | None = Field(None, ge=0, description="the loss of this step (0-based) becomes NaN")
    poison_step: int | None = Field(None, ge=0, description="first step (0-based, in the original data order) of a poisoned window")
    poison_steps: int = Field(1, ge=1, description="length of the poisoned window in steps")
    poison_factor: float = Field(100.0, gt=0, description="the poisoned batches' loss is multiplied by this")
    corrupt_checkpoint_step: int | None = Field(None, ge=1, description="after committing this step ...")
    corrupt_mode: Literal["truncate", "flip", "drop_manifest"] = Field("truncate", description="... damage it so")

    @model_validator(mode="after")
    def _pairs(self) -> "FaultsConfig":
        for a, b in (("kill_rank", "kill_step"), ("hang_rank", "hang_step")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"faults.{a} and faults.{b} go together (got {getattr(self, a)} and {getattr(self, b)})")
        return self
