"""Templates the launchers render: the sbatch script (`sbatch.sh.j2`) and the Kubernetes manifests
(`jobset.yaml.j2`, `pytorchjob.yaml.j2`). Jinja2 with undefined names as errors; manifest values go
through `tojson` and shell words through `q` (shlex.quote), so any string lands quoted and intact.
Copy one, edit it, and point a launcher's `template=` at the copy to change what a job looks like."""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

TEMPLATE_DIR = Path(__file__).resolve().parent


def render_template(template: str | Path, **values) -> str:
    """Render a template by name (in this folder) or by path; a missing value is an error."""
    path = Path(template)
    if not path.is_absolute() and not path.exists():
        path = TEMPLATE_DIR / template
    if not path.exists():
        known = ", ".join(sorted(p.name for p in TEMPLATE_DIR.glob("*.j2")))
        raise FileNotFoundError(f"template {template} not found (built-in: {known})")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(path.parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))  # shell-quote a value in the sbatch script
    return env.get_template(path.name).render(**values)
