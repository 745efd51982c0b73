"""The one validated config of a lifecycle: pydantic sections (`extra="forbid"`), YAML loading,
`--set a.b=c` overrides and error messages that name the field, the value and what is allowed."""

from .load import ConfigError, apply_overrides, config_to_yaml, load_config, load_raw, validate_config
from .schema import STAGES, LifecycleConfig

__all__ = [
    "STAGES",
    "ConfigError",
    "LifecycleConfig",
    "apply_overrides",
    "config_to_yaml",
    "load_config",
    "load_raw",
    "validate_config",
]
