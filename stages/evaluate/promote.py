"""After evaluation, the registry's aliases (seed: a model ships only once its evaluations pass).

The candidate is the model the export ships: its `hf/` version (stages/export/registry.py). It becomes
`champion` when every gate passed and it beats the current champion on the primary metric (with no
champion yet, passing the gates is enough); otherwise it becomes `challenger`. Equal is not better. A
champion it replaces loses the alias (tagged `eval.replaced_by`); the champion re-evaluated and failing
its gates loses it too. The lineage models (pretrain, sft, dpo) are baselines, never candidates, and the
quantized variants are other layouts of the candidate: serve finds them beside the champion by tag.

The primary metric is what the config already guards: the first gate's task/metric; with no gates, the
comparison table's first column (the first task's first metric, as compare.columns orders them).
"Better" follows the metric's direction (a lower perplexity, a higher accuracy).

Every evaluated version, candidate or not, gets the evaluation's figures as version tags: `eval.<task>/
<metric>` for each metric, `eval.primary_metric` / `eval.primary_value`, `eval.gates` (passed or failed,
the whole evaluation), `eval.gate_results` (this version's gates passed/total), `eval.gate_failures`,
`eval.run_id` (the evaluate stage's run) and, on the candidate, `eval.alias` and `eval.alias_reason`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..export.registry import CHALLENGER, CHAMPION, is_not_found, registry_client
from .compare import columns, flat_metrics
from .gates import GateResult


@dataclass
class Decision:
    alias: str  # champion or challenger
    reason: str
    replaced: int | None = None  # the champion version that lost the alias to this one


def primary_metric(gates: list, tasks: list[str], summaries: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(task, metric): the first gate's, else the comparison table's first column."""
    if gates:
        return gates[0].task, gates[0].metric
    cols = columns(summaries, tasks)
    if not cols:
        raise ValueError(f"no metric was evaluated for tasks {tasks}: no primary metric to rank models by")
    return cols[0]


def metric_key(task: str, metric: str) -> str:
    """The figure's name as flat_metrics writes it (and as the version tag `eval.<key>` holds it)."""
    return f"{task}/{metric.replace(',', '_')}"


def decide(gates_passed: bool, value: float | None, higher_is_better: bool, candidate: int,
           champion: int | None, champion_value: float | None) -> Decision:
    """The alias for the candidate version, from the gates and the primary metric (see the module doc)."""
    if not gates_passed:
        return Decision(CHALLENGER, "an evaluation gate failed")
    if champion is None:
        return Decision(CHAMPION, "the gates passed and there was no champion")
    if champion == candidate:
        return Decision(CHAMPION, "the champion was re-evaluated and passed its gates")
    if value is None or champion_value is None:
        which = "this model" if value is None else f"the champion (version {champion})"
        return Decision(CHALLENGER, f"{which} has no value of the primary metric: not compared")
    better = value > champion_value if higher_is_better else value < champion_value
    if better:
        return Decision(CHAMPION, f"beats the champion (version {champion}): {value:.6g} vs {champion_value:.6g}",
                        replaced=champion)
    return Decision(CHALLENGER, f"does not beat the champion (version {champion}): {value:.6g} vs {champion_value:.6g}")


def version_tags(variant: str, summary: dict[str, Any], results: list[GateResult], primary: str,
                 run_id: str | None) -> dict[str, str]:
    """The evaluation's figures for one evaluated version."""
    mine = [r for r in results if r.variant == variant]
    tags = {f"eval.{k}": f"{v:.6g}" for k, v in flat_metrics(summary).items()}
    tags.update({"eval.primary_metric": primary, "eval.gates": "passed" if all(r.passed for r in results) else "failed",
                 "eval.gate_results": f"{sum(r.passed for r in mine)}/{len(mine)} passed",
                 "eval.gate_failures": "; ".join(r.message for r in mine if not r.passed)[:5000],
                 "eval.run_id": run_id or ""})
    if f"eval.{primary}" in tags:
        tags["eval.primary_value"] = tags[f"eval.{primary}"]
    return {k: v for k, v in tags.items() if v != ""}


def _champion(client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as exc:
        if is_not_found(exc):
            return None
        raise


def _alias_on(client, name: str, alias: str) -> int | None:
    aliases = dict(client.get_registered_model(name).aliases or {})
    return int(aliases[alias]) if alias in aliases else None


def promote(tracking_uri: str, registered: dict[str, Any], evaluated: dict[str, str],
            summaries: dict[str, dict[str, Any]], results: list[GateResult], primary: tuple[str, str],
            run_id: str | None = None) -> dict[str, Any]:
    """Tag every evaluated version with its figures and set the candidate's alias. `registered` is the
    export's registry entry (export.json), `evaluated` maps an export folder (`hf`, `quantized/int8`) to
    the variant name it was evaluated as. Returns what was decided (written to promotion.json)."""
    from mlflow.exceptions import MlflowException

    name = registered["name"]
    client = registry_client(tracking_uri)
    key = metric_key(*primary)
    record: dict[str, Any] = {"model": name, "primary_metric": key, "tagged": {}}
    for path, variant in evaluated.items():
        entry = registered.get("versions", {}).get(path)
        if entry is None:
            continue
        try:
            client.get_model_version(name, str(entry["version"]))
        except MlflowException as exc:
            if not is_not_found(exc):
                raise
            record["skipped"] = (f"version {entry['version']} of {name!r} named by the export is not in the registry "
                                 f"at {tracking_uri}: no alias set")
            return record
        for k, v in version_tags(variant, summaries[variant], results, key, run_id).items():
            client.set_model_version_tag(name, str(entry["version"]), k, v)
        record["tagged"][variant] = entry["version"]

    shipped = registered.get("versions", {}).get("hf")
    if shipped is None or "hf" not in evaluated:
        record["skipped"] = "the shipped model (the export's hf/) was not evaluated: no alias set"
        return record
    variant, version = evaluated["hf"], int(shipped["version"])
    metric = summaries[variant]["metrics"].get(primary[0], {}).get(primary[1])
    value, higher = (metric["value"], metric["higher_is_better"]) if metric else (None, True)
    champ = _champion(client, name)
    champ_value = champ.tags.get(f"eval.{key}") if champ is not None else None
    decision = decide(all(r.passed for r in results), value, higher, version,
                      int(champ.version) if champ is not None else None,
                      float(champ_value) if champ_value is not None else None)

    client.set_registered_model_alias(name, decision.alias, str(version))
    other = CHALLENGER if decision.alias == CHAMPION else CHAMPION
    if _alias_on(client, name, other) == version:  # one version holds one of the two, never both
        client.delete_registered_model_alias(name, other)
    if decision.replaced is not None:
        client.set_model_version_tag(name, str(decision.replaced), "eval.replaced_by", str(version))
        client.set_model_version_tag(name, str(version), "eval.replaced", str(decision.replaced))
    client.set_model_version_tag(name, str(version), "eval.alias", decision.alias)
    client.set_model_version_tag(name, str(version), "eval.alias_reason", decision.reason)
    record.update({"version": version, "variant": variant, "value": value, **asdict(decision),
                   "champion_before": int(champ.version) if champ is not None else None})
    return record


def promote_evaluated(ctx, variants: list, summaries: dict[str, dict[str, Any]], results: list[GateResult],
                      log=print) -> dict[str, Any] | None:
    """The evaluate stage's call: the export input's registry entry and the folders evaluated from it, then
    `promote`; promotion.json in the output. None (nothing to do) when the stage is not tracked or the
    export registered nothing."""
    from .run import export_summary

    export = ctx.inputs.get("export")
    registered = export_summary(Path(export)).get("registered") if export is not None else None
    if not ctx.run_id or not registered or not registered.get("versions"):
        return None
    root = Path(export).resolve()
    evaluated = {}
    for v in variants:
        if v.name in summaries and v.path is not None and Path(v.path).resolve().is_relative_to(root):
            evaluated[Path(v.path).resolve().relative_to(root).as_posix()] = v.name
    cfg = ctx.cfg.evaluate
    record = promote(ctx.workspace.tracking_uri, registered, evaluated, summaries, results,
                     primary_metric(cfg.gates, cfg.tasks, summaries), ctx.run_id)
    (Path(ctx.out_dir) / "promotion.json").write_text(json.dumps(record, indent=2, default=float))
    if "alias" in record:
        log(f"evaluate: models:/{record['model']}/{record['version']} ({record['variant']}) is now "
            f"@{record['alias']}: {record['reason']}")
    else:
        log(f"evaluate: registry: {record.get('skipped')}")
    return record
