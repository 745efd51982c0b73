"""`evaluate_command`: the suite (or any lm-eval task) on Hugging Face folders named on the command line,
outside a lifecycle - `eightfold eval DIR [DIR...] --limit 50` - printing the variants x tasks table."""

from __future__ import annotations

from pathlib import Path


def evaluate_command(models: list[str], tasks: list[str] | None = None, limit: int | None = None,
                     data_dir: str | None = None, backend: str = "engine", out_dir: str = "eval-out",
                     max_gen_toks: int | None = None) -> int:
    """Evaluate each folder (named by its folder name) and write evaluation.md/.json into `out_dir`.
    Without `data_dir` (a data-stage output), the tasks needing held-out text are left out."""
    from rich.console import Console
    from rich.table import Table

    from infra.config.evaluate import SUITE_TASKS, EvaluateConfig

    from .compare import build_table, write_table
    from .run import evaluate_model, model_args, summarize
    from .suite import EvaluationDataError, task_manager, token_window_filter, validation_texts, write_suite

    console = Console()
    paths = [Path(m).expanduser().resolve() for m in models]
    bad = [str(p) for p in paths if not (p / "config.json").is_file()]
    if not paths or bad:
        console.print(f"[red]not Hugging Face model folders (no config.json): {bad or 'none given'}[/red]")
        return 2
    chosen = list(tasks or SUITE_TASKS)
    if data_dir is None and not tasks:
        chosen = [t for t in chosen if t not in ("eightfold_heldout_ppl", "eightfold_code_completion")]
    options = {"tasks": chosen, "limit": limit, "backend": backend}
    if max_gen_toks:
        options["max_gen_toks"] = max_gen_toks
    try:
        cfg = EvaluateConfig(**options)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    out = Path(out_dir).resolve()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(paths[0]))
        texts = validation_texts({"data": Path(data_dir)}) if data_dir else None
        window = int(__import__("json").loads((paths[0] / "config.json").read_text())["max_position_embeddings"]) - 2
        suite_dir, _ = write_suite(out / "suite", cfg, texts, token_window_filter(tok, window))
        tm = task_manager(suite_dir, cfg.tasks)
    except (EvaluationDataError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    summaries = {}
    for p in paths:
        with console.status(f"evaluating {p.name} on {', '.join(cfg.tasks)}"):
            summaries[p.name] = summarize(evaluate_model("eightfold", cfg.tasks, tm, cfg, model_args(cfg, p)), cfg)
    table = build_table(summaries, cfg.tasks)
    md, _ = write_table(table, out)
    view = Table(title="evaluation")
    view.add_column("variant")
    for c in table["columns"]:
        view.add_column(c)
    for r in table["rows"]:
        view.add_row(r["variant"], *[f"{r['cells'][c]['value']:.4g}" if r["cells"].get(c) else "-" for c in table["columns"]])
    console.print(view)
    console.print(f"table: {md}")
    return 0
