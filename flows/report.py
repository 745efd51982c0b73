"""What `eightfold run` / `eightfold stage` print at the end, and the report they leave behind.

`print_summary` prints the stages table and where to look, and writes
`<workdir>/report/<experiment>/report.md` and `report.html` (self-contained: PNGs embedded as
base64, and kept alongside for the markdown): stages (ran or cached, fingerprint, artifact, key
figures), loss curves (the pretrain run's MLflow metric history, or the job's metrics.jsonl), the
scaling-law fit (a PNG in the ablations artifact), the evaluation table across variants (the
evaluate artifact's evaluation.md), serving latency (the serve stage's figures and bench files), and
the commands to open the Prefect UI, the MLflow UI and to serve the result. Any stage may be missing:
its section says "not run".
"""

from __future__ import annotations

import base64
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from infra.config import LifecycleConfig
from infra.workspace import Workspace

LOSS_KEYS = ("loss", "val_loss")  # what the trainer logs per step (trainer/trainer.py)
NOT_RUN = "not run"


def _figures(summary: dict | None, limit: int | None = 4) -> str:
    items = [(k, v) for k, v in (summary or {}).items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items[:limit])
    return text + (f", ... ({len(items) - limit} more)" if limit is not None and len(items) > limit > 4 else "")


def print_summary(cfg: LifecycleConfig, refs: dict[str, dict], report: bool = True) -> Path | None:
    """The stages table and where to look; writes the report (unless `report=False`) and returns its path."""
    ws = Workspace.from_config(cfg)
    console = Console()
    table = Table(title=f"eightfold: {cfg.name}")
    for col in ("stage", "status", "fingerprint", "key figures", "artifact"):
        table.add_column(col, overflow="fold")
    for stage, ref in refs.items():
        table.add_row(stage, "cached" if ref.get("cached") else "ran", ref["fingerprint"], _figures(ref.get("summary")),
                      ref["uri"])
    console.print(table)
    for line in commands(ws):
        console.print(line)
    if not report:
        return None
    try:
        path = write_report(cfg, refs)
    except Exception as err:  # the run itself succeeded: a broken report must not hide that
        console.print(f"[yellow]report not written: {type(err).__name__}: {err}[/yellow]")
        return None
    console.print(f"Report:  {path}  and  {path.with_suffix('.html')}")
    return path


def commands(ws: Workspace) -> list[str]:
    api = os.environ.get("PREFECT_API_URL")
    home = os.environ.get("PREFECT_HOME")  # embedded runs keep their history there (flows/cli.py sets it)
    prefect = (f"Prefect: {api.removesuffix('/api')}" if api
               else f"Prefect: {f'PREFECT_HOME={home} ' if home else ''}prefect server start   (then open http://127.0.0.1:4200)")
    mlflow = (f"MLflow:  {ws.tracking_uri}   (experiment {ws.experiment!r})" if ws.tracking_uri.startswith("http")
              else f"MLflow:  mlflow ui --backend-store-uri {ws.tracking_uri}   (experiment {ws.experiment!r}, "
                   "then open http://127.0.0.1:5000)")
    return [prefect, mlflow, "Serve:   eightfold serve --latest   (an OpenAI-compatible server on the newest model)"]


# --- gathering ----------------------------------------------------------------------------------


@dataclass
class StageInfo:
    name: str
    ref: dict | None
    manifest: dict = field(default_factory=dict)
    artifact: Any = None  # infra.artifacts.Artifact

    @property
    def ran(self) -> bool:
        return self.ref is not None

    @property
    def files(self) -> dict[str, dict]:
        return self.manifest.get("files", {})

    def find(self, suffix: str, contains: str = "") -> list[str]:
        return sorted(n for n in self.files if n.endswith(suffix) and contains in n.rsplit("/", 1)[-1])

    def read(self, name: str) -> bytes:
        return self.artifact.store.get_bytes(self.artifact.key(name))


def _gather(cfg: LifecycleConfig, ws: Workspace, refs: dict[str, dict]) -> dict[str, StageInfo]:
    from infra.artifacts import find_artifact
    from stages.registry import STAGES

    names = list(STAGES) + [s for s in refs if s not in STAGES]
    out = {}
    for name in names:
        ref = refs.get(name)
        info = StageInfo(name, ref)
        if ref is not None:
            art = find_artifact(ws.store, ws.experiment, name, ref["fingerprint"])
            if art is not None:
                info.artifact, info.manifest = art, art.manifest
        out[name] = info
    return out


def _loss_history(ws: Workspace, info: StageInfo) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """{metric: [(step, value)]} from the pretrain run in MLflow, else from metrics.jsonl."""
    run_id = info.manifest.get("mlflow_run_id")
    if run_id:
        try:
            from mlflow import MlflowClient

            client = MlflowClient(ws.tracking_uri)
            keys = [k for k in client.get_run(run_id).data.metrics if "loss" in k]
            hist = {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}
            hist = {k: v for k, v in hist.items() if len(v) > 1}
            if hist:
                return hist, f"MLflow run {run_id}"
        except Exception:  # tracking unreachable: the artifact still has the job's own log
            pass
    for name in info.find("metrics.jsonl"):
        hist: dict[str, list] = {}
        for line in info.read(name).decode().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            for k in LOSS_KEYS:
                if isinstance(row.get(k), (int, float)):
                    hist.setdefault(k, []).append((int(row.get("step", 0)), float(row[k])))
        if hist:
            return hist, f"{info.artifact.url(name)}"
    return {}, ""


def _plot_losses(hist: dict[str, list[tuple[int, float]]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key, points in sorted(hist.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=key)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _latest_parent_run(ws: Workspace) -> str | None:
    """The newest lifecycle (or single-stage) parent run: the one this report is about."""
    try:
        from infra.tracking import Tracker

        tracker = Tracker.for_workspace(ws)
        runs = [r for kind in ("lifecycle", "stage")  # MLflow's search has no OR
                for r in tracker.client.search_runs([tracker.experiment_id], f"tags.kind = '{kind}'",
                                                    order_by=["attributes.start_time DESC"], max_results=1)]
        runs.sort(key=lambda r: r.info.start_time, reverse=True)
        return f"`{runs[0].info.run_name}`, {tracker.run_url(runs[0].info.run_id)}" if runs else None
    except Exception:  # tracking unreachable: the report is still worth writing
        return None


# --- rendering: a list of blocks, written as markdown and as HTML ---------------------------------


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def _parse_md_tables(text: str) -> list[tuple[list[str], list[list[str]]] | str]:
    """Pipe tables in a markdown text as (headers, rows); other lines kept as text."""
    out: list = []
    lines = text.splitlines()
    i = 0
    split = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]  # noqa: E731
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and set(lines[i + 1].replace("|", "").strip()) <= set("-: "):
            headers, rows, i = split(lines[i]), [], i + 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(split(lines[i]))
                i += 1
            out.append((headers, rows))
        else:
            if lines[i].strip():
                out.append(lines[i])
            i += 1
    return out


class Doc:
    def __init__(self, title: str):
        self.title = title
        self.blocks: list[tuple] = []

    def h2(self, text: str) -> None:
        self.blocks.append(("h2", text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        self.blocks.append(("table", headers, [[str(c) for c in r] for r in rows]))

    def image(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", path, alt))

    def code(self, text: str) -> None:
        self.blocks.append(("pre", text))

    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for b in self.blocks:
            if b[0] == "h2":
                out += [f"## {b[1]}", ""]
            elif b[0] == "p":
                out += [b[1], ""]
            elif b[0] == "table":
                out += [_md_table(b[1], b[2]), ""]
            elif b[0] == "img":
                out += [f"![{b[2]}]({b[1].name})", ""]
            elif b[0] == "pre":
                out += ["```", b[1], "```", ""]
        return "\n".join(out)

    def html(self) -> str:
        e = html.escape
        body = [f"<h1>{e(self.title)}</h1>"]
        for b in self.blocks:
            if b[0] == "h2":
                body.append(f"<h2>{e(b[1])}</h2>")
            elif b[0] == "p":
                body.append(f"<p>{_inline(b[1])}</p>")
            elif b[0] == "table":
                head = "".join(f"<th>{e(h)}</th>" for h in b[1])
                rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in b[2])
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
            elif b[0] == "img":
                data = base64.b64encode(Path(b[1]).read_bytes()).decode()
                body.append(f'<figure><img alt="{e(b[2])}" src="data:image/png;base64,{data}"><figcaption>{e(b[2])}'
                            "</figcaption></figure>")
            elif b[0] == "pre":
                body.append(f"<pre>{e(b[1])}</pre>")
        style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
                 "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;"
                 "text-align:left;font-size:.9em;vertical-align:top}th{background:#f3f3f3}code,pre{background:#f6f6f6;"
                 "font-size:.9em}pre{padding:.8em;overflow-x:auto}img{max-width:100%}figcaption{color:#666;font-size:.85em}")
        return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{e(self.title)}</title>"
                f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _inline(text: str) -> str:
    """`code` spans only: the report's own text is plain otherwise."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


# --- the report -----------------------------------------------------------------------------------


def _posttrain_row(name: str, m: dict) -> list[str]:
    def num(key: str, fmt: str) -> str:
        return format(m[key], fmt) if isinstance(m.get(key), (int, float)) else "-"

    limit = m.get("max_heldout_ppl_ratio")
    return [name, f"{num('heldout_accuracy_before', '.3f')} -> {num('heldout_accuracy_after', '.3f')}",
            f"{num('heldout_accuracy_gain', '+.3f')} ({num('heldout_accuracy_gain_se', '.3f')})",
            f"{num('heldout_ppl_before', '.4g')} -> {num('heldout_ppl_after', '.4g')}",
            num("heldout_ppl_ratio", ".3f") + (f" (limit {limit})" if limit is not None else "")]


def _rlhf_rows(summaries: dict[str, dict]) -> list[list[str]]:
    rows = []
    rm, ppo = summaries.get("posttrain-rm") or {}, summaries.get("posttrain-ppo") or {}
    if isinstance(rm.get("pairwise_accuracy_after"), (int, float)):
        rows.append(["posttrain-rm", f"pairwise accuracy {rm['pairwise_accuracy_after']:.3f} ± "
                     f"{rm.get('pairwise_accuracy_after_se', float('nan')):.3f} on {rm.get('pairs_n', '?')} held-out "
                     f"pairs, {rm.get('pairwise_accuracy_z', float('nan')):.1f} SE above chance; the SFT model's "
                     f"likelihood ranks {rm.get('sft_preference_accuracy_before', float('nan')):.3f}"])
    if isinstance(ppo.get("heldout_reward_after"), (int, float)):
        rows.append(["posttrain-ppo", f"held-out reward {ppo.get('heldout_reward_before', float('nan')):.3f} -> "
                     f"{ppo['heldout_reward_after']:.3f}, gain {ppo.get('heldout_reward_gain', float('nan')):+.3f} "
                     f"({ppo.get('heldout_reward_gain_se', float('nan')):.3f}); KL to SFT per sequence "
                     f"{ppo.get('train_kl', float('nan')):.3f} at coefficient {ppo.get('train_kl_coef', float('nan')):g}"])
    return rows


def write_report(cfg: LifecycleConfig, refs: dict[str, dict], out_dir: Path | None = None) -> Path:
    """Write report.md + report.html (+ PNGs) for the stages in `refs`; returns the .md path."""
    import time

    ws = Workspace.from_config(cfg)
    out = Path(out_dir) if out_dir else ws.workdir / "report" / ws.experiment
    if out.exists():
        for old in out.glob("*.png"):  # pictures of an earlier run must not survive into this one
            old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    info = _gather(cfg, ws, refs)
    doc = Doc(f"eightfold report: {cfg.name}")
    doc.p(f"Written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}. Artifact store `{ws.store_uri}`; "
          f"MLflow `{ws.tracking_uri}`, experiment `{ws.experiment}`.")

    doc.h2("Stages")
    rows = []
    for name, s in info.items():
        if not s.ran:
            rows.append([name, NOT_RUN, "", "", ""])
            continue
        status = "cached" if s.ref.get("cached") else "ran"
        rows.append([name, status, f"`{s.ref['fingerprint']}`", _figures(s.ref.get("summary") or s.manifest.get("summary"),
                                                                         10), f"`{s.ref['uri']}`"])
    doc.table(["stage", "status", "fingerprint", "key figures", "artifact"], rows)

    doc.h2("Loss curves")
    pre = info.get("pretrain")
    if pre is None or not pre.ran:
        doc.p(f"Pretraining: {NOT_RUN}.")
    else:
        hist, source = _loss_history(ws, pre)
        if hist:
            png = _plot_losses(hist, out / "loss_curves.png", f"pretrain {pre.ref['fingerprint']}")
            doc.image(png, f"Loss per step ({', '.join(sorted(hist))}) from {source}")
            last = {k: v[-1] for k, v in hist.items()}
            doc.table(["metric", "final step", "final value", "min value"],
                      [[k, step, f"{val:.4f}", f"{min(x for _, x in hist[k]):.4f}"] for k, (step, val) in sorted(last.items())])
        else:
            doc.p("The pretrain artifact has no loss history (no MLflow metrics and no metrics.jsonl).")

    doc.h2("Post-training")
    steps = [(name, s) for name, s in info.items() if name.startswith("posttrain-") and s.ran]
    if not steps:
        doc.p(f"Post-training: {NOT_RUN}.")
    else:
        doc.p("Each step's gain on the held-out task (with its paired standard error) and what it cost the language "
              "model: perplexity on held-out pretraining text, and its ratio to the pretrained model's.")
        summaries = {name: s.ref.get("summary") or s.manifest.get("summary") or {} for name, s in steps}
        doc.table(["step", "held-out accuracy", "gain (se)", "held-out ppl", "ppl / pretrained"],
                  [_posttrain_row(name, m) for name, m in summaries.items() if name != "posttrain-rm"])
        rlhf = _rlhf_rows(summaries)
        if rlhf:
            doc.p("Classic RLHF: the reward model's held-out pairwise accuracy (the right answer scored above a near "
                  "miss) with its binomial standard error and distance from chance, beside the SFT model's own "
                  "likelihood ranking of the same pairs; PPO's held-out reward (the reward model's mean score of the "
                  "greedy answers, paired standard error) and its KL to the SFT model.")
            doc.table(["step", "figures"], rlhf)

    doc.h2("Scaling-law fit")
    abl = info.get("ablations")
    if abl is None or not abl.ran:
        doc.p(f"Ablations: {NOT_RUN}.")
    else:
        pngs = abl.find(".png", "scaling") or abl.find(".png")
        for name in pngs[:6]:
            local = out / ("ablations_" + name.replace("/", "_"))
            local.write_bytes(abl.read(name))
            doc.image(local, f"{name} from {abl.artifact.uri}")
        if not pngs:
            doc.p(f"The ablations artifact holds no PNG. Figures: {_figures(abl.ref.get('summary'), None) or 'none'}.")

    doc.h2("Evaluation across variants")
    ev = info.get("evaluate")
    if ev is None or not ev.ran:
        doc.p(f"Evaluation: {NOT_RUN}.")
    else:
        tables = ev.find("evaluation.md") or ev.find(".md", "compar") or ev.find(".md", "eval")
        if tables:
            for part in _parse_md_tables(ev.read(tables[0]).decode()):
                if isinstance(part, tuple):
                    doc.table(*part)
                elif not part.startswith("#"):
                    doc.p(part.lstrip("- "))
        else:
            doc.p(f"No evaluation table in {ev.artifact.uri}. Figures: {_figures(ev.ref.get('summary'), None) or 'none'}.")

    doc.h2("Serving latency")
    sv = info.get("serve")
    if sv is None or not sv.ran:
        doc.p(f"Serving: {NOT_RUN}.")
    else:
        summary = sv.ref.get("summary") or sv.manifest.get("summary") or {}
        nums = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if nums:
            doc.table(["figure", "value"], [[k, f"{v:.4g}" if isinstance(v, float) else v] for k, v in nums.items()])
        for name in list(dict.fromkeys(sv.find(".md", "bench") + sv.find(".md", "latency")))[:2]:
            for part in _parse_md_tables(sv.read(name).decode()):
                if isinstance(part, tuple):
                    doc.table(*part)
        if not nums:
            doc.p(f"The serve artifact {sv.artifact.uri if sv.artifact else ''} reports no figures.")

    doc.h2("Where to look next")
    parent = _latest_parent_run(ws)
    if parent:
        doc.p(f"This run in MLflow: {parent}.")
    doc.code("\n".join(commands(ws)))

    md = out / "report.md"
    md.write_text(doc.markdown(), encoding="utf-8")
    md.with_suffix(".html").write_text(doc.html(), encoding="utf-8")
    return md

