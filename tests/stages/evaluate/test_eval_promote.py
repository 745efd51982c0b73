"""Evaluation sets the registry's aliases: the shipped model's version becomes champion when every gate
passes and it beats the champion on the primary metric (the first gate's), else challenger; the figures
and gate results become version tags. Through `promote` on a real registry (sqlite), and once through
the evaluate stage itself."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from mlflow import MlflowClient

from fixtures.registry_models import export_folder, register_export
from infra.config.evaluate import GateConfig
from stages.evaluate.gates import evaluate_gates
from stages.evaluate.promote import decide, metric_key, primary_metric, promote

TASK, METRIC = "eightfold_heldout_ppl", "bits_per_byte"
EVALUATED = {"hf": "grpo", "pretrain/hf": "pretrain", "quantized/int8": "int8"}
# every variant's bits per byte at most 2 (lower is better): the primary metric is this gate's
GATES = [GateConfig(variant="*", task=TASK, metric=METRIC, max=2.0)]


def _summaries(grpo: float, pretrain: float = 1.9, int8: float | None = None) -> dict:
    def one(v):
        return {"metrics": {TASK: {METRIC: {"value": v, "stderr": 0.01, "higher_is_better": False},
                                   "word_perplexity": {"value": 10 * v, "stderr": None, "higher_is_better": False}}}}
    return {"grpo": one(grpo), "pretrain": one(pretrain), "int8": one(grpo + 0.01 if int8 is None else int8)}


@pytest.fixture
def registry(tmp_path):
    uri = os.environ["MLFLOW_TRACKING_URI"]  # the session's sqlite database (tests/conftest.py)
    name = f"promote-{tmp_path.name}"
    client = MlflowClient(uri, registry_uri=uri)

    def evaluate(i: int, summaries: dict) -> tuple[dict, dict]:
        """A new export (its own versions), evaluated with these figures: (promotion record, registry entry)."""
        registered, _, _ = register_export(uri, name, export_folder(tmp_path / f"export{i}"), name)
        results = evaluate_gates(GATES, summaries)
        record = promote(uri, registered, EVALUATED, summaries, results, primary_metric(GATES, [TASK], summaries),
                         run_id=f"evaluate-run-{i}")
        return record, registered

    def aliases() -> dict[str, int]:
        return {a: int(v) for a, v in client.get_registered_model(name).aliases.items()}

    return evaluate, aliases, client, name


def test_champion_and_challenger_follow_gates_and_the_primary_metric(registry):
    evaluate, aliases, client, name = registry
    a, reg_a = evaluate(0, _summaries(1.5))  # the first that passes: champion
    va = reg_a["version"]
    assert (a["alias"], a["version"], a["champion_before"]) == ("champion", va, None)
    assert aliases() == {"champion": va}

    b, reg_b = evaluate(1, _summaries(1.7))  # passes, but worse: challenger
    assert b["alias"] == "challenger" and "does not beat the champion" in b["reason"]
    assert aliases() == {"champion": va, "challenger": reg_b["version"]}

    c, reg_c = evaluate(2, _summaries(1.2))  # better: takes champion, the old one loses the alias
    vc = reg_c["version"]
    assert (c["alias"], c["replaced"]) == ("champion", va)
    assert aliases() == {"champion": vc, "challenger": reg_b["version"]}
    assert client.get_model_version(name, str(va)).tags["eval.replaced_by"] == str(vc)

    d, reg_d = evaluate(3, _summaries(1.0, int8=2.5))  # best grpo, but int8 fails its gate: challenger
    assert d["alias"] == "challenger" and d["reason"] == "an evaluation gate failed"
    assert aliases() == {"champion": vc, "challenger": reg_d["version"]}

    # the figures and gate results as tags, on every evaluated version
    shipped = client.get_model_version(name, str(reg_d["version"])).tags
    assert float(shipped[f"eval.{TASK}/{METRIC}"]) == 1.0 and float(shipped[f"eval.{TASK}/{METRIC}_stderr"]) == 0.01
    assert shipped["eval.primary_metric"] == f"{TASK}/{METRIC}" and float(shipped["eval.primary_value"]) == 1.0
    assert shipped["eval.gates"] == "failed" and shipped["eval.gate_results"] == "1/1 passed"
    assert (shipped["eval.alias"], shipped["eval.run_id"]) == ("challenger", "evaluate-run-3")
    int8 = client.get_model_version(name, str(reg_d["versions"]["quantized/int8"]["version"])).tags
    assert int8["eval.gate_results"] == "0/1 passed" and "2.5 is above the maximum 2" in int8["eval.gate_failures"]
    assert float(int8[f"eval.{TASK}/word_perplexity"]) == 25.0 and "eval.alias" not in int8  # tagged, never a candidate
    pretrain = client.get_model_version(name, str(reg_d["versions"]["pretrain/hf"]["version"])).tags
    assert float(pretrain[f"eval.{TASK}/{METRIC}"]) == 1.9


def test_a_champion_that_fails_its_gates_on_reevaluation_loses_the_alias(registry, tmp_path):
    evaluate, aliases, client, name = registry
    first, reg = evaluate(0, _summaries(1.5))
    summaries = _summaries(2.2)  # the same version, evaluated again, now over the gate
    record = promote(os.environ["MLFLOW_TRACKING_URI"], reg, EVALUATED, summaries, evaluate_gates(GATES, summaries),
                     primary_metric(GATES, [TASK], summaries))
    assert record["alias"] == "challenger" and aliases() == {"challenger": reg["version"]}


def test_decide_and_the_primary_metric():
    assert decide(True, 0.6, True, candidate=3, champion=2, champion_value=0.5).alias == "champion"  # higher is better
    assert decide(True, 0.5, True, candidate=3, champion=2, champion_value=0.5).alias == "challenger"  # a tie keeps it
    no_value = decide(True, 0.4, False, candidate=3, champion=2, champion_value=None)
    assert no_value.alias == "challenger" and no_value.reason.startswith("the champion (version 2) has no value")
    assert decide(True, 9.9, False, candidate=2, champion=2, champion_value=0.1).alias == "champion"  # itself
    summaries = _summaries(1.0)
    assert primary_metric(GATES, [TASK], summaries) == (TASK, METRIC)
    # with no gates: the comparison table's first column (the first task's first metric)
    assert primary_metric([], [TASK], summaries) == (TASK, METRIC)
    assert metric_key("eightfold_arith", "exact_match,strict-match") == "eightfold_arith/exact_match_strict-match"


def test_evaluate_stage_sets_the_alias_of_the_export_it_evaluated(tmp_path, export_dir, data_dir):
    """The stage reads the registry entry from export.json, tags the versions it evaluated and moves the
    alias before a failing gate stops it."""
    from test_eval_stage import QUICK, _ctx

    from stages.evaluate.gates import GateFailed
    from stages.evaluate.stage import run

    uri = os.environ["MLFLOW_TRACKING_URI"]
    name = f"evaltest-{tmp_path.name}"
    client = MlflowClient(uri, registry_uri=uri)
    variants = [{"name": "grpo", "path": "export:hf"}, {"name": "fp8", "path": "export:quantized/fp8"}]

    def stage(i: int, minimum: float):
        export = tmp_path / f"export{i}"
        for rel in ("hf", "quantized/fp8"):
            shutil.copytree(export_dir / rel, export / rel)
        registered, _, _ = register_export(uri, name, export, name, quantized=("fp8",))
        (export / "export.json").write_text(json.dumps({"source_step": "grpo", "registered": registered}))
        gates = [{"variant": "grpo", "task": "eightfold_arith", "metric": "exact_match", "min": minimum}]
        ctx, _, _ = _ctx(tmp_path / f"run{i}", export, data_dir, {**QUICK, "tasks": ["eightfold_arith"], "limit": 2,
                                                                  "variants": variants, "gates": gates})
        return ctx, registered

    (tmp_path / "run0").mkdir()
    ctx, reg = stage(0, 0.0)
    summary = run(ctx)
    assert (summary["registry_alias"], summary["registry_version"]) == ("champion", reg["version"])
    promotion = json.loads((ctx.out_dir / "promotion.json").read_text())
    assert promotion["primary_metric"] == "eightfold_arith/exact_match" and promotion["tagged"] == {
        "grpo": reg["version"], "fp8": reg["versions"]["quantized/fp8"]["version"]}
    table = json.loads((ctx.out_dir / "evaluation.json").read_text())
    value = table["rows"][0]["cells"]["eightfold_arith/exact_match"]["value"]
    tags = client.get_model_version(name, str(reg["version"])).tags
    assert float(tags["eval.eightfold_arith/exact_match"]) == pytest.approx(value) and tags["eval.gates"] == "passed"
    assert tags["eval.run_id"] == ctx.run_id

    (tmp_path / "run1").mkdir()
    ctx, reg2 = stage(1, 1.1)  # an exact-match rate can never reach 1.1: the gate fails
    with pytest.raises(GateFailed):
        run(ctx)
    aliases = {a: int(v) for a, v in client.get_registered_model(name).aliases.items()}
    assert aliases == {"champion": reg["version"], "challenger": reg2["version"]}
    assert json.loads((ctx.out_dir / "promotion.json").read_text())["alias"] == "challenger"
