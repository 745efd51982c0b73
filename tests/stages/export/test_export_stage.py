"""The export stage end to end: a pretrain output folder holding a DCP checkpoint (with optimizer state),
the tokenizer artifact and packed validation tokens -> hf/, every quantized variant, validation.json, the
size table, and every exported folder a model version whose source run is the export stage's run."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from infra.config import LifecycleConfig
from infra.workspace import Workspace
from stages.base import StageContext
from trainer.shards import PackedShardWriter


def make_inputs(tmp_path, trained_tiny):
    import torch.distributed.checkpoint as dcp

    pretrain = tmp_path / "pretrain"
    ckpt = pretrain / "checkpoints" / "step_000100"
    sd = trained_tiny.state_dict
    optim = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in sd.items()}}
    dcp.save({"model": sd, "optim": optim}, checkpoint_id=str(ckpt))
    (ckpt / "manifest.json").write_text("{}")
    (pretrain / "result.json").write_text(json.dumps({"status": "completed", "steps": 100,
                                                      "checkpoint": "checkpoints/step_000100"}))
    tokens = tmp_path / "tokens"
    writer = PackedShardWriter(tokens / "val", seq_len=64, vocab_size=512, eos_id=1, rows_per_shard=8)
    for row in trained_tiny.val_rows.tolist() + trained_tiny.train_rows[:8].tolist():
        writer.add(row[:-1])  # each row + EOS is one 65-token row
    writer.close()
    return pretrain, tokens


@pytest.mark.slow
def test_export_stage_end_to_end(tmp_path, trained_tiny, export_tokenizer_dir):
    from mlflow import MlflowClient

    from infra.tracking import Tracker
    from stages.export.stage import run

    pretrain, tokens = make_inputs(tmp_path, trained_tiny)
    cfg = LifecycleConfig.model_validate({
        "name": "export-test",
        "model": trained_tiny.cfg.model_dump(),
        "tokenizer": {"vocab_size": 512},
        "pretrain": {"seq_len": 64, "micro_batch_size": 2, "global_batch_size": 2, "warmup_steps": 0, "steps": 1},
        "export": {"validation_rows": 8, "awq_calibration_rows": 8, "awq_grid": 6, "greedy_tokens": 8},
    })
    ws = Workspace(tmp_path / "ws", f"file://{tmp_path / 'ws' / 'artifacts'}", f"sqlite:///{tmp_path / 'mlflow.db'}",
                   "export-test")
    tracker = Tracker(ws.tracking_uri, ws.experiment, (tmp_path / "mlartifacts").as_uri())
    parent = tracker.start_run("lifecycle")
    stage_run = tracker.start_run("export", parent_run_id=parent)
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(cfg=cfg, workspace=ws, out_dir=out, run_id=stage_run,
                       inputs={"pretrain": pretrain, "tokenizer": export_tokenizer_dir, "tokens": tokens},
                       log_metrics=lambda m, step=None: tracker.log_metrics(stage_run, m, step))
    figures = run(ctx)

    assert figures["architecture"] == "LlamaForCausalLM"
    assert (out / "hf" / "model.safetensors.index.json").is_file()
    assert (out / "hf" / "tokenizer.json").is_file()
    for v in cfg.export.variants:
        folder = out / "quantized" / v
        assert (folder / ("model.gguf" if v.startswith("gguf") else "config.json")).is_file(), v
    report = json.loads((out / "validation.json").read_text())
    assert [r["variant"] for r in report["variants"]] == ["hf", *cfg.export.variants]
    assert all(r["passed"] for r in report["variants"])
    table = json.loads((out / "size_table.json").read_text())
    seed = {r["variant"]: r for r in table["seed-1b (from shapes)"]}
    assert seed["training state"]["bytes"] == pytest.approx(20.4e9, rel=0.01)  # seed: 20.4 GB of training state
    assert seed["hf (bfloat16)"]["bytes"] == pytest.approx(2.55e9, rel=0.01)  # -> 2.5 GB of bf16 weights
    tiny = {r["variant"]: r for r in table["export-test"]}
    assert tiny["int4"]["measured_bytes"] < tiny["int8"]["measured_bytes"] < tiny["hf (bfloat16)"]["measured_bytes"]
    # the size from shapes agrees with the files (headers and index aside)
    assert tiny["gguf-q8_0"]["measured_bytes"] == pytest.approx(tiny["gguf-q8_0"]["bytes"], rel=0.05)
    assert "| int4-awq |" in (out / "size_table.md").read_text()

    # every folder a model version whose source run is the export stage's own run
    client = MlflowClient(ws.tracking_uri)
    registered = json.loads((out / "export.json").read_text())["registered"]
    assert sorted(registered["versions"]) == sorted(["hf", *(f"quantized/{v}" for v in cfg.export.variants)])
    assert figures["registered_version"] == registered["version"] == registered["versions"]["hf"]["version"]
    for path, entry in registered["versions"].items():
        mv = client.get_model_version("export-test", str(entry["version"]))
        assert mv.run_id == stage_run and mv.tags["lifecycle_run_id"] == parent and mv.source.endswith(f"/{path}")
        assert mv.tags["path"] == path and mv.tags["checkpoint_step"] == "100"
    shipped = client.get_model_version("export-test", str(registered["version"]))
    assert (shipped.tags["variant"], shipped.tags["kind"]) == ("pretrain", "shipped")
    metrics = MlflowClient(ws.tracking_uri).get_run(stage_run).data.metrics
    assert metrics["export.int8.ppl_ratio"] < 1.05


def test_stage_fails_naming_variant_and_metric(tmp_path, trained_tiny, export_tokenizer_dir):
    """An impossible threshold makes the stage fail after writing validation.json, naming what failed."""
    from stages.export.stage import run
    from stages.export.validate import ValidationFailed

    pretrain, tokens = make_inputs(tmp_path, trained_tiny)
    thresholds = {"hf": {}, "int8": {"max_ppl_ratio": 1.0, "min_greedy_agreement": 1.0, "max_logit_diff": 1e-9}}
    cfg = LifecycleConfig.model_validate({
        "name": "export-fail",
        "model": trained_tiny.cfg.model_dump(),
        "tokenizer": {"vocab_size": 512},
        "pretrain": {"seq_len": 64, "micro_batch_size": 2, "global_batch_size": 2, "warmup_steps": 0, "steps": 1},
        "export": {"variants": ["int8"], "thresholds": thresholds, "dtype": "float32", "validation_rows": 4,
                   "greedy_tokens": 4},
    })
    ws = Workspace(tmp_path / "ws", f"file://{tmp_path / 'ws'}", f"sqlite:///{tmp_path / 'mlflow.db'}", "x")
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(cfg=cfg, workspace=ws, out_dir=out,
                       inputs={"pretrain": pretrain, "tokenizer": export_tokenizer_dir, "tokens": tokens})
    with pytest.raises(ValidationFailed, match=r"variant int8: logits differ"):
        run(ctx)
    report = json.loads((out / "validation.json").read_text())
    assert [r["passed"] for r in report["variants"]] == [True, False]


@pytest.mark.parametrize("moe_kw", [dict(), dict(shared_expert=True, every=2)])
def test_moe_variants_validate(tmp_path, moe_kw):
    """Mixtral and Qwen2-MoE exports: every compressed-tensors variant (experts quantized, routers not)
    round-trips within its threshold; GGUF holds the Mixtral form (stacked experts) and is skipped, with
    the reason recorded, for a shared expert."""
    from export_models import random_model_state, tiny_cfg

    from infra.config.export import ExportConfig
    from infra.config.model import MoEConfig
    from stages.export.stage import export_variants
    from stages.export.validate import CheckData

    cfg = tiny_cfg(vocab_size=256, moe=MoEConfig(num_experts=4, top_k=2, **moe_kw))
    sd = random_model_state(cfg)
    rows = torch.randint(0, 256, (6, 33), generator=torch.Generator().manual_seed(0))
    ec = ExportConfig(variants=["fp8", "int8", "int4", "int4-awq", "gguf-q8_0"], dtype="float32", awq_grid=4)
    data = CheckData(rows[:4], [rows[4, :5].tolist()], greedy_tokens=6)
    reports, sizes, notes = export_variants(sd, cfg, tmp_path, ec, None, data, rows[4:], log=lambda *_: None)
    gguf = [] if moe_kw else ["gguf-q8_0"]
    assert [r.variant for r in reports] == ["hf", "fp8", "int8", "int4", "int4-awq", *gguf]
    assert all(r.passed for r in reports), [r.failures for r in reports]
    if moe_kw:
        assert "shared_expert=True" in notes["skipped"]["gguf-q8_0"]
    else:
        import gguf as gg

        reader = gg.GGUFReader(str(tmp_path / "quantized" / "gguf-q8_0" / "model.gguf"))
        shapes = {t.name: list(t.shape) for t in reader.tensors}
        assert shapes["blk.0.ffn_gate_exps.weight"] == [cfg.dim, cfg.ffn_dim, 4]  # ggml order: [in, out, E]
        assert shapes["blk.0.ffn_gate_inp.weight"] == [cfg.dim, 4]
        assert reader.fields["llama.expert_count"].contents() == 4
        assert reader.fields["llama.expert_used_count"].contents() == 2
    assert notes["architecture"] == ("Qwen2MoeForCausalLM" if moe_kw else "MixtralForCausalLM")


def test_export_ships_the_last_model_of_the_chain_and_its_lineage(tmp_path, trained_tiny, export_tokenizer_dir):
    """With pretrain and a post-train step as inputs, hf/ holds the post-train model, pretrain/hf the
    pretrained one (each equal to its own weights), the step's LoRA adapter ships beside them, and the
    evaluate stage names the rows after the steps, in lifecycle order."""
    from safetensors.torch import load_file, save_file

    from infra.config.evaluate import EvaluateConfig
    from stages.evaluate.run import discover_variants
    from stages.export.hf import hf_architecture, to_hf_state_dict
    from stages.export.stage import run

    from mlflow import MlflowClient

    from infra.tracking import Tracker
    from trainer.lora import apply_lora, merged_state_dict, save_peft
    from trainer.model import Transformer

    pretrain, tokens = make_inputs(tmp_path, trained_tiny)
    sft = tmp_path / "posttrain-sft"  # as the post-train job leaves it: merged weights + adapter/ (PEFT)
    model = Transformer(trained_tiny.cfg)
    model.load_state_dict(trained_tiny.state_dict)
    apply_lora(model, r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "down_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    save_peft(model, sft / "adapter")
    tuned = merged_state_dict(model)
    save_file({k: v.contiguous() for k, v in tuned.items()}, str(sft / "model.safetensors"))
    cfg = LifecycleConfig.model_validate({
        "name": "export-chain",
        "model": trained_tiny.cfg.model_dump(),
        "tokenizer": {"vocab_size": 512},
        "pretrain": {"seq_len": 64, "micro_batch_size": 2, "global_batch_size": 2, "warmup_steps": 0, "steps": 1},
        "export": {"variants": ["int8"], "validation_rows": 4, "greedy_tokens": 4, "dtype": "float32",
                   "registered_model_name": f"chain-{tmp_path.name}"},
    })
    # the session's MLflow database (tests/conftest.py): a fresh one costs ~10 s of migrations
    ws = Workspace(tmp_path / "ws", f"file://{tmp_path / 'ws' / 'artifacts'}", os.environ["MLFLOW_TRACKING_URI"], "x")
    stage_run = Tracker(ws.tracking_uri, ws.experiment, str(tmp_path / "mlartifacts")).start_run("export")
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(cfg=cfg, workspace=ws, out_dir=out, run_id=stage_run,
                       inputs={"pretrain": pretrain, "posttrain-sft": sft, "tokenizer": export_tokenizer_dir,
                               "tokens": tokens})
    assert run(ctx)["source"] == "posttrain-sft"

    def exported(folder):
        sd = {}
        for f in sorted(folder.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        return sd

    arch = hf_architecture(cfg.model)
    for folder, weights in ((out / "hf", tuned), (out / "pretrain" / "hf", trained_tiny.state_dict)):
        want = to_hf_state_dict(weights, cfg.model, arch, torch.float32)
        got = exported(folder)
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), folder
    summary = json.loads((out / "export.json").read_text())
    assert summary["source_step"] == "sft" and summary["lineage"] == {"pretrain": "pretrain/hf"}
    adapter = summary["adapters"]["sft"]
    assert (adapter["path"], adapter["base"], adapter["r"]) == ("adapters/sft", "pretrain/hf", 4)
    assert adapter["merge_max_rel_diff"] < 1e-3  # the shipped adapter is what the merged weights hold
    conf = json.loads((out / "adapters" / "sft" / "adapter_config.json").read_text())
    assert (out / "adapters" / "sft" / conf["base_model_name_or_path"] / "config.json").is_file()
    report = json.loads((out / "validation.json").read_text())
    assert [r["variant"] for r in report["variants"]] == ["hf", "int8", "pretrain"]
    assert all(r["passed"] for r in report["variants"])

    variants = discover_variants(EvaluateConfig(), {"export": out})
    assert [v.name for v in variants] == ["pretrain", "sft", "int8"]
    # each a model version of the stage's run, tagged with the row name evaluate gives it and its checkpoint
    client = MlflowClient(ws.tracking_uri)
    versions = {path: client.get_model_version(f"chain-{tmp_path.name}", str(e["version"]))
                for path, e in summary["registered"]["versions"].items()}
    assert {p: (v.tags["variant"], v.tags["kind"]) for p, v in versions.items()} == {
        "hf": ("sft", "shipped"), "pretrain/hf": ("pretrain", "lineage"), "quantized/int8": ("int8", "quantized")}
    assert {v.run_id for v in versions.values()} == {stage_run}
    assert versions["pretrain/hf"].tags["checkpoint_step"] == "100" and "checkpoint_step" not in versions["hf"].tags

    with pytest.raises(ValueError, match="export.source='posttrain-grpo' is not among"):
        run(dataclasses.replace(ctx, cfg=cfg.model_copy(update={"export": cfg.export.model_copy(
            update={"source": "posttrain-grpo"})})))


def test_both_branches_ship_grpo_and_export_ppo_beside_it():
    """posttrain.chain both: GRPO's model ships, PPO's (the other branch's last) is exported with the rest;
    each adapter's base is the model its step started from."""
    from stages.export.stage import PARENT, model_chain

    inputs = dict.fromkeys(["pretrain", "posttrain-sft", "posttrain-dpo", "posttrain-grpo", "posttrain-ppo", "tokens"])
    shipped, others = model_chain(inputs, "final")
    assert shipped == ("posttrain-grpo", "grpo")
    assert [s for _, s in others] == ["pretrain", "sft", "ppo", "dpo"]
    assert model_chain(dict.fromkeys(["pretrain", "posttrain-sft", "posttrain-ppo"]), "final")[0] == ("posttrain-ppo", "ppo")
    assert PARENT["ppo"] == PARENT["dpo"] == "sft" and PARENT["grpo"] == "dpo"
