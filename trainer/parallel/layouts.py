"""Which combinations of the parallel techniques this trainer composes, refused with the reason
before any group is built. The rules live in `infra.config.parallel.unsupported_layout` so config
validation (`eightfold config show`) refuses the same layouts before anything starts; the trainer
checks again at start, for a config that did not come through validation."""

from __future__ import annotations

from infra.config.model import ModelConfig
from infra.config.parallel import ParallelConfig, unsupported_layout


def check_supported(parallel: ParallelConfig, model: ModelConfig | None = None) -> None:
    reason = unsupported_layout(parallel, model)
    if reason:
        raise NotImplementedError(reason)
