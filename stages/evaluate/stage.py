"""`run(ctx)`: the evaluate stage. Inputs: the export artifact (`hf/` and `quantized/<variant>/`; any
other input holding model folders adds variants, e.g. pretrain and post-train exports) and `data` (or
`tokens`) for held-out text. Writes the offline suite, runs lm-eval on every variant through the serving
engine, writes the comparison table, logs one nested MLflow run per variant, then applies the gates.

Output folder:
  suite/                 the YAML tasks and their data files, exactly as evaluated (`lm_eval
                         --include_path suite/` runs them wherever the folder is copied)
  results/<variant>.json the metrics of each variant (value, stderr, direction, examples)
  samples/<variant>/     per-example outputs, one jsonl per task
  evaluation.md / .json  the variants x tasks table
  promotion.json         when the export registered its models: the alias the shipped model's version got
                         (champion or challenger, promote.py) and why; every evaluated version is tagged
                         with its figures. A cache hit of this stage moves no alias: the artifact's
                         evaluation already did, and a re-run (`--force evaluate`) decides again.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..base import StageContext
from .compare import as_columns, build_table, flat_metrics, log_variant_runs, write_table
from .gates import evaluate_gates, raise_failed
from .promote import promote_evaluated
from .run import Variant, discover_variants, evaluate_model, export_summary, model_args, summarize, write_samples
from .suite import task_manager, token_window_filter, validation_texts, write_suite


def load_model(v: Variant, args: dict[str, Any], unloadable: str, notes: dict[str, str]):
    """The `eightfold` lm-eval model over one variant: the engine loads the folder itself (Hugging Face
    safetensors, compressed-tensors FP8/INT8/packed INT4, or a GGUF file); a layout it cannot load runs
    as dequantized weights on the engine when unloadable=dequantize (recorded in `notes`)."""
    from ..serve.gguf_loader import find_gguf
    from .backends import dequantized_engine_backend
    from .lm_model import EightfoldLM

    native_error: Exception | None = None
    if (v.path / "config.json").is_file() or find_gguf(v.path) is not None:
        try:
            return EightfoldLM(**args)
        except Exception as exc:  # noqa: BLE001 - any load failure falls through to the policy below
            native_error = exc
    if unloadable != "dequantize" or v.base is None or args.get("backend", "engine") != "engine":
        raise native_error or FileNotFoundError(f"{v.path} has no config.json")
    engine_opts = {k: args[k] for k in ("dtype", "device", "kv_cache_memory_gb") if k in args}
    backend = dequantized_engine_backend(v.path, v.base, **engine_opts)
    why = f"{type(native_error).__name__}: {native_error}" if native_error else "a GGUF file, no config.json"
    notes[v.name] = (f"weights dequantized by the export stage's reference reader, run on the engine with "
                     f"{v.base.name}/'s architecture and tokenizer (native load: {why})")
    rest = {k: v_ for k, v_ in args.items() if k not in ("pretrained", "backend", *engine_opts)}
    return EightfoldLM(backend=backend, **rest)


def lineage_caption(inputs: dict[str, Any]) -> str:
    """What the rows are, when the export says which model it shipped and which came before it."""
    shipped = export_summary(Path(inputs["export"])) if "export" in inputs else {}
    if not shipped.get("source_step"):
        return ""
    chain = [*shipped.get("lineage", {}), shipped["source_step"]]
    return (f"Rows: the lifecycle's models in order ({', '.join(chain)}), then the quantized variants of "
            f"`{shipped['source_step']}`, the model the export ships.")


def _window(cfg, model_dir: Path) -> int:
    """The scoring window every variant uses (they share the architecture's context length)."""
    if cfg.max_length:
        return cfg.max_length
    shape = json.loads((model_dir / "config.json").read_text())
    return int(shape.get("max_position_embeddings", 2048)) - (2 if cfg.backend == "engine" else 0)


def run(ctx: StageContext) -> dict[str, Any]:
    from transformers import AutoTokenizer

    cfg = ctx.cfg.evaluate
    t0 = time.perf_counter()
    variants = discover_variants(cfg, ctx.inputs)
    runnable = [v for v in variants if v.path is not None]
    skipped = {v.name: v.skipped for v in variants if v.path is None}
    first = next((v.path for v in runnable if (v.path / "config.json").is_file()), None) or runnable[0].base
    tokenizer = AutoTokenizer.from_pretrained(str(first))
    window = _window(cfg, first)
    ctx.log_params({"evaluate.variants": ",".join(v.name for v in runnable), "evaluate.tasks": ",".join(cfg.tasks),
                    "evaluate.backend": cfg.backend, "evaluate.limit": cfg.limit, "evaluate.window": window})

    needs_text = bool({"eightfold_heldout_ppl", "eightfold_code_completion"} & set(cfg.tasks))
    texts = validation_texts(ctx.inputs, tokenizer) if needs_text else None
    suite_dir, counts = write_suite(ctx.out_dir / "suite", cfg, texts, fits=token_window_filter(tokenizer, window))
    tm = task_manager(suite_dir, cfg.tasks)

    summaries: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    files: dict[str, Path] = {}
    params: dict[str, dict[str, Any]] = {}
    for v in runnable:
        t = time.perf_counter()
        args = model_args(cfg, v.path)
        if not cfg.max_length:
            args["max_length"] = window
        try:
            lm = load_model(v, args, cfg.unloadable, notes)
        except Exception as exc:
            if cfg.unloadable == "skip":
                skipped[v.name] = f"the serving engine could not load it: {type(exc).__name__}: {exc}"
                continue
            raise RuntimeError(f"variant {v.name!r} ({v.path}): the serving engine could not load it: "
                               f"{type(exc).__name__}: {exc} (evaluate.unloadable=skip lists it as skipped)") from exc
        try:
            raw = evaluate_model(lm, cfg.tasks, tm, cfg)
        except Exception as exc:
            raise RuntimeError(f"evaluating variant {v.name!r} ({v.path}) failed: {exc}") from exc
        finally:
            del lm  # one engine (and its KV cache) at a time
        s = summarize(raw, cfg)
        s["seconds"] = round(time.perf_counter() - t, 2)
        summaries[v.name] = s
        write_samples(raw, ctx.out_dir / "samples" / v.name)
        files[v.name] = ctx.out_dir / "results" / f"{v.name}.json"
        files[v.name].parent.mkdir(parents=True, exist_ok=True)
        files[v.name].write_text(json.dumps(s, indent=2, default=float))
        params[v.name] = {"path": str(v.path), "backend": cfg.backend, "window": window, "limit": cfg.limit,
                          "loaded": notes.get(v.name, "natively by the engine")}

    if not summaries:
        raise RuntimeError(f"no variant could be evaluated: {skipped}")
    # lm-eval imported suite/utils.py: its bytecode names this build's staging folder, and is no part of the suite
    shutil.rmtree(suite_dir / "__pycache__", ignore_errors=True)
    table = build_table(summaries, cfg.tasks, skipped, notes, caption=lineage_caption(ctx.inputs))
    md, js = write_table(table, ctx.out_dir)
    ctx.log_artifact(md)
    ctx.log_artifact(js)
    ctx.log_table(as_columns(table), "evaluation_table.json")
    if ctx.run_id:
        from infra.tracking import Tracker

        ws = ctx.workspace
        tracker = Tracker(ws.tracking_uri, ws.experiment, artifact_location=str(ws.mlflow_artifacts))
        log_variant_runs(tracker, ctx.run_id, summaries, params, files)

    # Gates last: a failing gate stops the stage, after the table and the runs that explain it exist, and
    # after the registry's aliases say so (a model that fails its gates is a challenger, never champion).
    results = evaluate_gates(cfg.gates, summaries)
    promotion = promote_evaluated(ctx, runnable, summaries, results)
    raise_failed(results)
    summary: dict[str, Any] = {"variants": len(summaries), "skipped_variants": len(skipped), "gates_passed": len(results),
                               "seconds": round(time.perf_counter() - t0, 2),
                               **{f"examples/{k}": v for k, v in counts.items()}}
    if promotion and "alias" in promotion:
        summary.update({"registry_version": promotion["version"], "registry_alias": promotion["alias"]})
    for name, s in summaries.items():
        summary.update({f"{name}/{k}": v for k, v in flat_metrics(s).items() if not k.endswith("_stderr")})
    return summary
