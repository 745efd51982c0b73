"""Named configurations for `eightfold estimate --preset NAME`: full LifecycleConfig YAMLs in configs/presets/."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from infra.config.load import CONFIG_DIR, ConfigError, load_config
from infra.config.schema import LifecycleConfig

PRESET_DIR = CONFIG_DIR / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError([("--preset", name, f"no such preset; known: {', '.join(preset_names())}")])
    return path


def load_preset(name: str, overrides: Iterable[str] = ()) -> LifecycleConfig:
    """The preset's config with `--set` overrides applied and validated."""
    return load_config(preset_path(name), overrides)
