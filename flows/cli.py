"""`eightfold`: the command line. Heavy imports (torch, prefect, mlflow) happen inside commands so
`eightfold config show` answers at once."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="eightfold: data, tokenizer, ablations, pretrain, post-train, export, evaluate, serve.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configs.")
bench_app = typer.Typer(no_args_is_help=True, help="Speed figures (JSON lines with ratios against a baseline).")
app.add_typer(config_app, name="config")
drill_app = typer.Typer(no_args_is_help=True, help="Failure drills: break something on purpose, check the recovery.")
app.add_typer(bench_app, name="bench")
app.add_typer(drill_app, name="drill")

SetOpt = typer.Option([], "--set", "-s", help="override any field: --set pretrain.lr=3e-4 (repeatable)")


def _prefect_env(cfg) -> None:
    """Embedded Prefect by default: its state under the work dir, not ~/.prefect."""
    if "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ:
        from infra.workspace import Workspace

        os.environ["PREFECT_HOME"] = str(Workspace.from_config(cfg).path("prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load(config: str | None, overrides: list[str]):
    from infra.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)


@config_app.command("show")
def config_show(config: Optional[str] = typer.Argument(None, help="config file or built-in name (tiny, seed-1b)"),
                overrides: list[str] = SetOpt) -> None:
    """Print the resolved config (defaults filled in, overrides applied, validated)."""
    from infra.config import config_to_yaml

    print(config_to_yaml(_load(config, overrides)), end="")


@app.command()
def run(
    config: Optional[str] = typer.Argument(None, help="config file or built-in name (default: tiny)"),
    overrides: list[str] = SetOpt,
    stages: Optional[str] = typer.Option(None, help="comma-separated subset of stages"),
    force: list[str] = typer.Option([], "--force", help="re-run this stage and everything downstream"),
) -> None:
    """Run the lifecycle flow (embedded Prefect, local MLflow and store unless configured)."""
    cfg = _load(config, overrides)
    _prefect_env(cfg)
    from infra.config.load import resolve_config_path

    from flows.lifecycle import lifecycle
    from flows.report import print_summary

    selected = [s.strip() for s in stages.split(",")] if stages else None
    result = lifecycle(config=str(resolve_config_path(config)), overrides=overrides, stages=selected, force=force)
    print_summary(cfg, result)


@app.command()
def stage(
    name: str = typer.Argument(..., help="stage to run"),
    config: Optional[str] = typer.Argument(None),
    overrides: list[str] = SetOpt,
    inputs: list[str] = typer.Option([], "--input", help="pin an upstream artifact: STAGE=FINGERPRINT"),
    force: bool = typer.Option(False, "--force", help="re-run even when the artifact exists"),
) -> None:
    """Run one stage on the latest committed upstream artifacts."""
    cfg = _load(config, overrides)
    _prefect_env(cfg)
    from infra.config.load import resolve_config_path

    from flows.report import print_summary
    from flows.stages import STAGE_FLOWS
    from tasks.stage import MissingUpstream

    pinned = dict(i.split("=", 1) for i in inputs)
    if name not in STAGE_FLOWS:
        console.print(f"[red]unknown stage {name!r}; known: {', '.join(STAGE_FLOWS)}[/red]")
        raise typer.Exit(2)
    try:
        ref = STAGE_FLOWS[name](config=str(resolve_config_path(config)), overrides=overrides, inputs=pinned,
                                force=force)
    except MissingUpstream as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(3)
    print_summary(cfg, {name: ref}, report=False)


@app.command()
def artifacts(
    stage_name: Optional[str] = typer.Argument(None, metavar="[STAGE]"),
    config: Optional[str] = typer.Option(None, "--config", "-c"),
    overrides: list[str] = SetOpt,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Committed artifacts, newest first."""
    from infra.artifacts_view import artifacts_command

    raise typer.Exit(artifacts_command(config, overrides, stage_name, as_json))


@app.command()
def health(config: Optional[str] = typer.Argument(None), overrides: list[str] = SetOpt,
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Devices, a timed all-reduce, matmul throughput, disk, store and tracking round trips."""
    from infra.health import health_command

    raise typer.Exit(health_command(config, overrides, as_json))


@app.command()
def estimate(
    config: Optional[str] = typer.Argument(None),
    preset: Optional[str] = typer.Option(None, "--preset", help="seed-1b, seed-1b-moe, llama3-70b, llama3-405b"),
    overrides: list[str] = SetOpt,
    as_json: bool = typer.Option(False, "--json"),
    plot: Optional[str] = typer.Option(None, "--plot", help="write PNGs to this folder"),
    serve: bool = typer.Option(False, "--serve", help="serving view: KV capacity, TTFT, TPOT, tokens/s by concurrency"),
) -> None:
    """Memory, FLOPs, communication (bytes and seconds per link), step time and pipeline bubble for a config
    and layout; with --serve, inference: KV capacity, TTFT, TPOT and throughput by concurrency."""
    from trainer.estimate.cli import estimate_command

    raise typer.Exit(estimate_command(config, preset, overrides, as_json, plot, serve=serve))


@app.command()
def deploy(
    pool: str = typer.Option("eightfold-process", "--pool", help="work pool (created if missing; a name with "
                             "'kubernetes' makes a Kubernetes pool)"),
    cron: str = typer.Option("0 2 * * *", "--cron", help="the lifecycle's schedule (UTC); 'none' for no schedule"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="config the deployments run (default tiny)"),
    overrides: list[str] = SetOpt,
    image: Optional[str] = typer.Option(None, "--image", help="image holding this project (Kubernetes pools)"),
    source: Optional[str] = typer.Option(None, "--source", help="where workers get the code (default: this checkout)"),
) -> None:
    """Register the lifecycle (on a cron schedule) and one deployment per stage on PREFECT_API_URL."""
    from flows.deploy import deploy_command

    raise typer.Exit(deploy_command(pool, cron, config, overrides, image=image, source=source))


@app.command()
def compare(
    run_a: str = typer.Argument(..., help="MLflow run id, Prefect flow-run id or run name"),
    run_b: str = typer.Argument(...),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="config naming the MLflow URI and experiment"),
    overrides: list[str] = SetOpt,
) -> None:
    """Two lifecycle runs side by side: config values that differ, key metrics per stage, MLflow link."""
    from flows.compare import compare_command

    raise typer.Exit(compare_command(run_a, run_b, config, overrides))


@app.command("eval")
def eval_models(
    models: list[str] = typer.Argument(..., help="Hugging Face checkpoint folders (export hf/ or quantized/<v>/)"),
    tasks: Optional[str] = typer.Option(None, help="comma-separated lm-eval task names (default: the offline suite)"),
    limit: Optional[int] = typer.Option(None, help="examples per task"),
    data: Optional[str] = typer.Option(None, "--data", help="a data-stage output folder (held-out text tasks)"),
    backend: str = typer.Option("engine", help="engine (our serving engine) or hf (transformers reference)"),
    out: str = typer.Option("eval-out", help="where evaluation.md/.json go"),
) -> None:
    """lm-evaluation-harness on model folders through the serving engine, outside the lifecycle."""
    from stages.evaluate.command import evaluate_command

    raise typer.Exit(evaluate_command(models, tasks.split(",") if tasks else None, limit, data, backend, out))


PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command(context_settings=PASS_THROUGH)
def serve(
    ctx: typer.Context,
    model_dir: Optional[str] = typer.Argument(None, help="a Hugging Face checkpoint folder (the export's hf/), or a "
                                              "registered model: models:/NAME@champion, models:/NAME/VERSION"),
    latest: bool = typer.Option(False, "--latest", help="serve the newest committed export artifact"),
    config: Optional[str] = typer.Option(None, "--config", "-c",
                                         help="config naming the store (with --latest) or the MLflow tracking URI"),
) -> None:
    """OpenAI-compatible server (paged KV, continuous batching, prefix caching, speculative decoding).
    Engine options pass through: --host, --port, --api-key, --max-num-seqs, --speculative ngram, ..."""
    if latest == (model_dir is not None):
        console.print("[red]give MODEL_DIR or --latest (one of them)[/red]")
        raise typer.Exit(2)
    if model_dir is not None and model_dir.startswith("models:"):
        model_dir = _registered_model_dir(model_dir, config)
    if latest:
        from infra.workspace import Workspace
        from stages.serve.stage import latest_export_dir

        try:
            model_dir = str(latest_export_dir(Workspace.from_config(_load(config, []))))
        except FileNotFoundError as err:
            console.print(f"[red]{err}[/red]")
            raise typer.Exit(3)
    from stages.serve.cli import main as serve_main

    raise typer.Exit(serve_main(["serve", model_dir, *ctx.args]))


def _registered_model_dir(uri: str, config: str | None) -> str:
    """models:/NAME@ALIAS or models:/NAME/VERSION, downloaded from the workspace's MLflow into
    `<workdir>/registry/NAME/VERSION`; an unknown model, alias or version exits 3 naming it."""
    from infra.workspace import Workspace
    from stages.export.registry import RegistryError, fetch_model, resolve_model_uri

    ws = Workspace.from_config(_load(config, []))
    try:
        mv = resolve_model_uri(ws.tracking_uri, uri)
    except RegistryError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(3)
    folder = fetch_model(ws.tracking_uri, mv, ws.path("registry"))
    console.print(f"{uri} is version {mv.version} ({mv.tags.get('variant', '?')}, from run {mv.run_id}): {folder}")
    return str(folder)


BENCHMARKS = {
    "train": "benchmarks.train_throughput",
    "data": "benchmarks.data_throughput",
    "serve": "benchmarks.serve_throughput",
    "parallel": "benchmarks.parallel_layouts",
    "checkpoint": "benchmarks.checkpoint",
}


@bench_app.command("run", context_settings=PASS_THROUGH)
def bench_run(ctx: typer.Context, name: str = typer.Argument(..., help=", ".join([*BENCHMARKS, "all"]))) -> None:
    """Run a benchmark (extra options pass through); `all` runs each with its defaults."""
    import importlib

    names = list(BENCHMARKS) if name == "all" else [name]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        console.print(f"[red]unknown benchmark {unknown[0]!r}; known: {', '.join(BENCHMARKS)}, all[/red]")
        raise typer.Exit(2)
    for n in names:
        try:
            module = importlib.import_module(BENCHMARKS[n])
        except ModuleNotFoundError as err:
            console.print(f"[yellow]{n}: not available ({err})[/yellow]")
            continue
        module.main(list(ctx.args))


@bench_app.command("serve", context_settings=PASS_THROUGH, add_help_option=False)
def bench_serve(ctx: typer.Context) -> None:
    """Load benchmark like `vllm bench serve`: TTFT/TPOT/ITL/e2e and output tokens/s as JSON
    (--baseline hf, --speculative-bench, --concurrency, --request-rate, MODEL_DIR ...)."""
    from stages.serve.cli import main as serve_main

    raise typer.Exit(serve_main(["bench", *ctx.args], bench_prog="eightfold bench serve"))


@drill_app.command("node-loss")
def drill_node_loss(
    config: Optional[str] = typer.Argument(None),
    overrides: list[str] = SetOpt,
    as_json: bool = typer.Option(False, "--json", help="print only the drill's JSON object"),
    elastic: Optional[bool] = typer.Option(None, "--elastic/--same-nodes",
                                           help="retry on the node left (default: infra.elastic)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="seed of the step the node is lost at"),
    launcher: str = typer.Option("auto", "--launcher", help="auto (Slurm when two nodes are up), local or slurm"),
) -> None:
    """Lose one node of a two-node pretrain job at a random step; check the retry resumes from the last
    checkpoint in the store and ends where the uninterrupted job ends. Exit 1 when it does not."""
    import json

    from infra.drill import DrillFailed, node_loss
    from stages.registry import STAGES
    from tasks.stage import execute_stage

    cfg = _load(config, overrides)
    say = (lambda m: None) if as_json else (lambda m: console.print(m))
    refs: dict = {}
    for name in ("data", "tokenizer", "tokens"):  # the packed tokens the job reads (cached when committed)
        refs[name] = execute_stage(cfg, name, {k: refs[k] for k in STAGES[name].inputs}, log=say)
    try:
        report = node_loss(cfg, refs["tokens"].uri, elastic=elastic, seed=seed, launcher=launcher, log=say)
    except DrillFailed as err:
        console.print(f"[red]drill node-loss failed: {err}[/red]")
        raise typer.Exit(1)
    print(json.dumps(report, indent=None if as_json else 2))
    raise typer.Exit(0 if report["equal"] and report["shared_paths"] == 0 else 1)


def main() -> None:
    import signal

    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        signal.default_int_handler(signum, frame)  # KeyboardInterrupt: jobs are cancelled on the way out

    signal.signal(signal.SIGINT, on_sigint)
    try:
        app()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        sys.exit(130)
    except Exception:
        # Ctrl-C reaches the whole foreground group, Prefect's temporary server included: reporting the
        # crash to it then fails too. That is still an interruption, not an error of ours.
        if not interrupted:
            raise
        console.print("[yellow]interrupted[/yellow]")
        sys.exit(130)


if __name__ == "__main__":
    main()
