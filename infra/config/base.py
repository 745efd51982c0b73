"""Shared pydantic base for every config section: unknown keys are errors, assignment re-validates."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. `extra="forbid"` turns a typo into an error that names the key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
