"""Read a YAML config, apply `--set a.b=c` overrides, validate, and explain every error."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from .schema import LifecycleConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(ValueError):
    """A config that cannot run. `problems` lists (field path, value given, what is allowed)."""

    def __init__(self, problems: list[tuple[str, Any, str]], source: str = "config"):
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s)"]
        for path, value, allowed in problems:
            # Section-level (cross-field) errors name their fields and values in the message itself.
            shown = "" if value is _MISSING or isinstance(value, (dict, list)) else f" = {value!r}"
            lines.append(f"  {path or '(root)'}{shown}: {allowed}")
        super().__init__("\n".join(lines))


_MISSING = object()


def resolve_config_path(name_or_path: str | Path | None) -> Path:
    """A path, or a name in configs/ (`tiny`, `seed-1b`)."""
    if name_or_path is None:
        name_or_path = "tiny"
    p = Path(name_or_path)
    if p.exists():
        return p
    for candidate in (CONFIG_DIR / f"{name_or_path}.yaml", CONFIG_DIR / str(name_or_path)):
        if candidate.exists():
            return candidate
    known = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError([("config", str(name_or_path), f"no such file; built-in configs: {', '.join(known)}")])


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML so numbers, bools and lists get their types)."""
    if "=" not in text:
        raise ConfigError([("--set", text, "expected KEY=VALUE, e.g. pretrain.lr=3e-4")])
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError([("--set", text, "expected a dotted field path such as model.n_layers")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                path = ".".join(parts[: i + 1])
                raise ConfigError([(path, child, f"is not a section, cannot set {'.'.join(parts)}")])
            node = child
        node[parts[-1]] = value
    return out


def _lookup(raw: Any, loc: tuple) -> Any:
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return _MISSING
    return node


def _explain(err: ValidationError, raw: dict) -> list[tuple[str, Any, str]]:
    problems = []
    for e in err.errors():
        # pydantic puts the union/literal member tag in loc for some errors; keep only real keys.
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check spelling; see `eightfold config show`)"
        elif e["type"] == "literal_error":
            msg = f"allowed: {e.get('ctx', {}).get('expected', msg)}"
        problems.append((".".join(str(p) for p in loc), _lookup(raw, loc), msg))
    return problems


def validate_config(raw: dict, source: str = "config") -> LifecycleConfig:
    if not isinstance(raw, dict):
        raise ConfigError([("(root)", raw, "a config is a YAML mapping of sections")], source)
    try:
        return LifecycleConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, raw), source) from None


def load_raw(path: str | Path | None) -> tuple[dict, str]:
    p = resolve_config_path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([("(file)", str(p), f"not valid YAML: {exc}")], str(p)) from None
    return raw, str(p)


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> LifecycleConfig:
    """Load, override, validate. Raises ConfigError naming every bad field before anything starts."""
    raw, source = load_raw(path)
    return validate_config(apply_overrides(raw, overrides), source)


def config_to_yaml(cfg: LifecycleConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
