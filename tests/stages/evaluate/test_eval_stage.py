"""The evaluate stage end to end on an export-shaped folder (hf/, an FP8 variant, a GGUF-only folder)
and a data artifact: the table, the per-variant nested MLflow runs, and gates that stop the stage."""

from __future__ import annotations

import json

import pytest

from infra.config import LifecycleConfig
from infra.workspace import Workspace
from stages.base import StageContext


def _ctx(tmp_path, export_dir, data_dir, evaluate: dict, with_tracking: bool = True):
    from infra.tracking import Tracker

    import os

    cfg = LifecycleConfig.model_validate({"name": "evaltest", "evaluate": evaluate})
    # the session's MLflow database (tests/conftest.py): creating a fresh one costs ~10 s of migrations
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{tmp_path}/mlflow.db"
    ws = Workspace(tmp_path / "work", f"file://{tmp_path}/artifacts", uri, f"evaltest-{tmp_path.name}")
    tracker = Tracker(ws.tracking_uri, ws.experiment, artifact_location=str(ws.mlflow_artifacts)) if with_tracking else None
    run_id = tracker.start_run("evaluate") if tracker else None
    logged = []
    ctx = StageContext(cfg=cfg, workspace=ws, out_dir=tmp_path / "out", inputs={"export": export_dir, "data": data_dir},
                       run_id=run_id, log_artifact=logged.append,
                       log_table=lambda data, name: logged.append((name, data)))
    ctx.out_dir.mkdir()
    return ctx, tracker, logged


QUICK = {"limit": 3, "max_gen_toks": 6, "max_length": 96, "heldout_examples": 10, "ppl_max_docs": 2,
         "ppl_max_chars": 600, "code_max_functions": 4, "code_max_body_chars": 300, "bootstrap_iters": 20}


@pytest.mark.slow
def test_stage_evaluates_every_variant_into_one_table_and_nested_runs(tmp_path, export_dir, data_dir):
    from stages.evaluate.stage import run

    gates = [{"variant": "hf", "task": "eightfold_heldout_ppl", "metric": "byte_perplexity", "max": 1e6},
             {"variant": "fp8", "task": "eightfold_heldout_ppl", "metric": "bits_per_byte", "baseline": "hf",
              "max_loss": 0.05, "relative": True}]
    ctx, tracker, logged = _ctx(tmp_path, export_dir, data_dir, {**QUICK, "gates": gates})
    summary = run(ctx)

    table = json.loads((ctx.out_dir / "evaluation.json").read_text())
    assert [r["variant"] for r in table["rows"]] == ["hf", "fp8", "gguf-q8_0", "int4"]
    assert not table["skipped"]
    assert not table["notes"]  # every variant, packed INT4 and GGUF included, loaded natively by the engine
    assert "eightfold_heldout_ppl/bits_per_byte" in table["columns"]
    assert "eightfold_arith/exact_match" in table["columns"] and "eightfold_arith_mc/acc" in table["columns"]
    hf_bpb = table["rows"][0]["cells"]["eightfold_heldout_ppl/bits_per_byte"]
    fp8_bpb = table["rows"][1]["cells"]["eightfold_heldout_ppl/bits_per_byte"]
    assert hf_bpb["stderr"] > 0 and hf_bpb["stderr_kind"] == "bootstrap over documents"
    # each variant's own weights really ran: close to, but not exactly, the unquantized numbers
    for row in table["rows"][1:]:
        bpb = row["cells"]["eightfold_heldout_ppl/bits_per_byte"]["value"]
        assert bpb != hf_bpb["value"] and bpb == pytest.approx(hf_bpb["value"], rel=0.05), row["variant"]
    md = (ctx.out_dir / "evaluation.md").read_text()
    assert "| hf |" in md and "| fp8 |" in md and " ± " in md
    assert ctx.out_dir / "evaluation.md" in logged and ctx.out_dir / "evaluation.json" in logged
    # the same table as an MLflow table: a column per figure, its stderr beside it
    (columns,) = [data for item in logged if isinstance(item, tuple) and item[0] == "evaluation_table.json"
                  for data in [item[1]]]
    assert columns["variant"] == ["hf", "fp8", "gguf-q8_0", "int4"]
    assert columns["eightfold_heldout_ppl/bits_per_byte"][1] == fp8_bpb["value"]
    assert columns["eightfold_heldout_ppl/bits_per_byte stderr"][0] == hf_bpb["stderr"]
    assert summary["variants"] == 4 and summary["gates_passed"] == 2
    assert summary["hf/eightfold_heldout_ppl/bits_per_byte"] == pytest.approx(hf_bpb["value"])
    assert (ctx.out_dir / "suite" / "eightfold_code_completion.yaml").exists()
    assert (ctx.out_dir / "samples" / "fp8" / "eightfold_arith.jsonl").exists()

    # one nested MLflow run per variant, under the stage's run, with the table's numbers
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{ctx.run_id}'")
    by_variant = {r.data.tags["variant"]: r for r in runs}
    assert set(by_variant) == {"hf", "fp8", "gguf-q8_0", "int4"}
    assert by_variant["fp8"].data.metrics["eightfold_heldout_ppl/bits_per_byte"] == pytest.approx(fp8_bpb["value"])
    assert by_variant["hf"].info.status == "FINISHED"


def test_a_failing_gate_stops_the_stage_naming_variant_task_metric_and_values(tmp_path, export_dir, data_dir):
    from stages.evaluate.gates import GateFailed
    from stages.evaluate.stage import run

    quick = {**QUICK, "tasks": ["eightfold_heldout_ppl"], "variants": [{"name": "final", "path": "export:hf"}],
             "gates": [{"variant": "final", "task": "eightfold_heldout_ppl", "metric": "byte_perplexity", "max": 1.0}]}
    ctx, _, _ = _ctx(tmp_path, export_dir, data_dir, quick, with_tracking=False)
    with pytest.raises(GateFailed) as err:
        run(ctx)
    msg = str(err.value)
    value = json.loads((ctx.out_dir / "evaluation.json").read_text())["rows"][0]["cells"][
        "eightfold_heldout_ppl/byte_perplexity"]["value"]
    assert "variant 'final'" in msg and "eightfold_heldout_ppl" in msg and "byte_perplexity" in msg
    assert f"{value:.6g}" in msg and "above the maximum 1" in msg


def test_config_rejects_gates_on_unknown_variants_and_tasks():
    with pytest.raises(ValueError, match="variant 'grpo'"):
        LifecycleConfig.model_validate({"evaluate": {"variants": [{"name": "hf", "path": "export:hf"}], "gates": [
            {"variant": "grpo", "task": "eightfold_arith", "metric": "exact_match", "min": 0.1}]}})
    with pytest.raises(ValueError, match="task 'mmlu'"):
        LifecycleConfig.model_validate({"evaluate": {"gates": [
            {"variant": "hf", "task": "mmlu", "metric": "acc", "min": 0.3}]}})
    with pytest.raises(ValueError, match="either min/max, or baseline with max_loss"):
        LifecycleConfig.model_validate({"evaluate": {"gates": [
            {"variant": "hf", "task": "eightfold_arith", "metric": "exact_match"}]}})


def test_missing_inputs_are_named(tmp_path, export_dir):
    from stages.evaluate.run import discover_variants
    from infra.config.evaluate import EvaluateConfig

    with pytest.raises(ValueError, match="no model folder to evaluate"):
        discover_variants(EvaluateConfig(), {"data": tmp_path})
    with pytest.raises(ValueError, match="no input named 'posttrain'"):
        discover_variants(EvaluateConfig(variants=[{"name": "x", "path": "posttrain:hf"}]), {"export": export_dir})
    names = [v.name for v in discover_variants(EvaluateConfig(), {"export": export_dir, "pretrain": export_dir / "hf"})]
    assert names == ["hf", "fp8", "gguf-q8_0", "int4", "pretrain"]


@pytest.mark.parametrize("policy", ["fail", "skip", "dequantize"])
def test_a_variant_nothing_can_load_fails_or_is_skipped_by_policy(tmp_path, export_dir, data_dir, policy):
    import shutil

    from eval_variants import write_broken_variant
    from stages.evaluate.stage import run

    export = tmp_path / "export"
    shutil.copytree(export_dir / "hf", export / "hf")
    write_broken_variant(export / "hf", export / "quantized" / "broken")
    quick = {**QUICK, "tasks": ["eightfold_arith"], "limit": 2, "unloadable": policy}
    ctx, _, _ = _ctx(tmp_path, export, data_dir, quick, with_tracking=False)
    if policy == "skip":
        run(ctx)
        table = json.loads((ctx.out_dir / "evaluation.json").read_text())
        assert [r["variant"] for r in table["rows"]] == ["hf"]
        assert "could not load" in table["skipped"]["broken"]
    else:
        with pytest.raises(RuntimeError, match="variant 'broken' .* the serving engine could not load it"):
            run(ctx)


def test_evaluate_command_rejects_folders_that_are_not_models(tmp_path, capsys):
    from stages.evaluate.command import evaluate_command

    assert evaluate_command([str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().out
