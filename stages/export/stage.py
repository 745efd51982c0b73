"""The export stage: pretrain checkpoint -> hf/ (Hugging Face safetensors), quantized/<variant>/ (FP8, INT8,
INT4 RTN and AWQ in compressed-tensors layouts; GGUF for llama.cpp), every variant validated against the
unquantized model, a size table, and every one of them a version in the MLflow model registry (registry.py).

Inputs: the model chain `pretrain` -> `posttrain-sft`, then its branches -> `posttrain-dpo` -> `posttrain-grpo`
and -> `posttrain-ppo` (those posttrain.chain runs; each a trainer output folder: result.json naming the
checkpoint, checkpoints/, or model.safetensors),
`tokenizer` (tokenizer.json and friends, copied beside the weights), `tokens` (the packed splits: the
`val/` rows give the perplexity check and the AWQ calibration activations). `export.source` picks the
model that ships (default: the last of the chain present, GRPO's when both branches ran); with
`export.lineage` every other model of the chain is exported unquantized too (PPO's, the other branch's
last, among them), so evaluate puts the whole lifecycle in one table.
Output folder:
  hf/                      config.json, generation_config.json, model-0000i-of-0000n.safetensors,
                           model.safetensors.index.json, tokenizer files
  <step>/hf/               the other models of the chain (pretrain, sft, ppo, dpo), unquantized, validated alike
  adapters/<step>/         a post-train step's LoRA adapter in PEFT format, against <the step it started from>/hf
  quantized/<variant>/     the same layout with quantization_config (fp8, int8, int4, int4-awq) or model.gguf
  validation.json          per variant: perplexity, ratio, greedy agreement, logit diff, pass/fail
  size_table.md/.json      bytes per variant for this model and, from shapes, for configs/seed-1b.yaml
  export.json              summary: architecture, checkpoint, registry entry (`registered`: the shipped
                           model's version and `versions`, one per folder above: path -> version, variant)
The stage fails (ValidationFailed) naming the variant and the metric when a threshold is crossed, after
writing validation.json so the numbers are there to read.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from infra.config.model import ModelConfig

from ..base import StageContext
from . import hf as hf_layout
from .gguf_export import GGUF_VARIANTS, GGUFUnsupported, check_supported, write_gguf
from .merge import complete_state_dict, find_checkpoint, load_full_state_dict
from .quantize import quantization_config, quantize_state_dict, unquantized_linears
from .sizes import markdown, size_rows
from .validate import (CheckData, VariantReport, build_reference, check_variant, enforce, folder_forward,
                       gguf_forward, our_forward, relative_diff, stored_weights, transformers_forward)

SEED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "seed-1b.yaml"
# The lifecycle's models, each after the one it starts from: (input name, short name used for folders and table
# rows). PPO's branch comes before DPO -> GRPO's, so "final" is GRPO's model when both branches ran.
CHAIN = (("pretrain", "pretrain"), ("posttrain-sft", "sft"), ("posttrain-ppo", "ppo"), ("posttrain-dpo", "dpo"),
         ("posttrain-grpo", "grpo"))
PARENT = {"sft": "pretrain", "ppo": "sft", "dpo": "sft", "grpo": "dpo"}  # the model each step starts from


def model_chain(inputs: dict[str, Any], source: str) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    """(the shipped model, the models exported beside it) as (input name, short name) pairs: source "final"
    ships the last chain input present and exports every other; a named source (among the inputs) ships that
    one and exports those before it."""
    present = [(name, short) for name, short in CHAIN if name in inputs]
    if not present:
        raise ValueError(f"the export stage needs a model input (one of {[n for n, _ in CHAIN]}); got {sorted(inputs)}")
    if source == "final":
        return present[-1], present[:-1]
    names = [n for n, _ in present]
    if source not in names:
        raise ValueError(f"export.source={source!r} is not among the stage's inputs {sorted(inputs)}")
    i = names.index(source)
    return present[i], present[:i]


def export_adapter(posttrain_dir: Path, short: str, prev: str, base: dict[str, torch.Tensor],
                   merged: dict[str, torch.Tensor], cfg: ModelConfig, out: Path) -> dict[str, Any] | None:
    """A post-train step trained with LoRA left adapter/ (PEFT format, Hugging Face names) beside its merged
    model: checked against the pair (merged = base + scaling * B A) and shipped under adapters/<step>/ with
    base_model_name_or_path pointing at the model it applies to (`prev`, the one the step started from).
    None when the step trained without LoRA."""
    from .peft_adapter import find_adapter, write_peft_adapter

    adapter = find_adapter(posttrain_dir)
    if adapter is None:
        return None
    info = write_peft_adapter(adapter, out / "adapters" / short, cfg, base_model=f"../../{prev}/hf", base=base,
                              merged=merged)
    return {"path": f"adapters/{short}", "base": f"{prev}/hf", **info}


def validation_rows(tokens_dir: Path, n_val: int, n_calib: int, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n_val rows of the val split for the check, the next n_calib for AWQ calibration (so the
    check stays held out from calibration when the split is big enough; otherwise they overlap)."""
    from trainer.shards import PackedShards

    split = tokens_dir / "val"
    if not split.is_dir():
        raise FileNotFoundError(f"tokens input {tokens_dir} has no val/ split (needed for validation and calibration)")
    shards = PackedShards(split)
    total = len(shards)
    if total == 0:
        raise ValueError(f"{split} holds no rows")
    val_ids = list(range(min(n_val, total)))
    calib_ids = [(n_val + i) % total for i in range(n_calib)]
    val, calib = torch.from_numpy(shards.rows(val_ids)), torch.from_numpy(shards.rows(calib_ids))
    if seq_len is not None:
        val, calib = val[:, : seq_len + 1], calib[:, : seq_len + 1]
    return val.long(), calib.long()


def encode_prompts(tokenizer_dir: Path | None, prompts: list[str], rows: torch.Tensor) -> list[list[int]]:
    """The fixed prompts as token ids; without a tokenizer, the first 8 tokens of validation rows."""
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
        if all(ids):
            return ids
    return [rows[i % rows.shape[0], :8].tolist() for i in range(len(prompts))]


def write_quantized_folder(sd: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, scheme: str, dtype: str,
                           group: int, fp8_activations: bool, tokenizer_dir: Path | None, max_shard_mb: float,
                           moe_architecture: str, note: dict[str, Any] | None = None) -> int:
    """A compressed-tensors folder: quantized safetensors + config.json with quantization_config."""
    arch = hf_layout.hf_architecture(cfg, moe_architecture)
    hf = hf_layout.to_hf_state_dict(sd, cfg, arch, hf_layout.DTYPES[dtype])
    tensors = quantize_state_dict(hf, scheme, group)
    files = hf_layout.write_safetensors(tensors, out, int(max_shard_mb * 2**20))
    ids = hf_layout.special_token_ids(tokenizer_dir)
    conf = hf_layout.hf_config(cfg, arch, dtype, ids)
    conf["quantization_config"] = quantization_config(scheme, group, fp8_activations,
                                                      unquantized_linears(hf, scheme, group))
    if note:
        conf["quantization_config"]["eightfold"] = note
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    hf_layout.write_generation_config(out, ids, tokenizer_dir)
    hf_layout.copy_tokenizer(tokenizer_dir, out)
    return sum((out / f).stat().st_size for f in files)


def for_model(data: CheckData, short: str) -> CheckData:
    """The check data of one model of the chain: held-out conversations only for the post-trained ones."""
    return data if short != "pretrain" else dataclasses.replace(data, chat_rows=None)


def cast_report(sd: dict[str, torch.Tensor], cfg: ModelConfig, dtype: str, data: CheckData, cast) -> dict[str, Any]:
    """What the cast to the export dtype alone does to the trained fp32 model (information for the reader),
    from `cast`, the reference already built on the cast weights: only the fp32 model is run here."""
    exact = build_reference(our_forward(sd, cfg), data)
    diffs = [relative_diff(cast.logits, exact.logits)]
    chat = None
    if cast.chat_logits is not None:
        chat = cast.chat_ppl / exact.chat_ppl
        diffs.append(relative_diff(cast.chat_logits, exact.chat_logits))
    same = [a == b for c, e in zip(cast.continuations, exact.continuations) for a, b in zip(c, e)]
    return {"dtype": dtype, "ppl_fp32": exact.ppl, "ppl_ratio": cast.ppl / exact.ppl, "chat_ppl_ratio": chat,
            "greedy_tokens_equal": sum(same) / max(len(same), 1), "max_logit_diff": max(diffs)}


def export_variants(sd: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, ec, tokenizer_dir: Path | None,
                    data: CheckData, calib: torch.Tensor, log=print) -> tuple[list[VariantReport], dict[str, int], dict]:
    """Write hf/ and every variant, validating each against the unquantized model as it is written.
    Returns (reports, bytes on disk per variant, notes such as skipped variants and AWQ losses)."""
    refs: dict[str, Any] = {}

    def reference(variant: str):
        """The model as `variant` stores it before quantization (validate.stored_weights), run in fp32."""
        key = {"gguf-f16": "float16/matrices", "gguf-bf16": "bfloat16/matrices"}.get(
            variant, "float32" if variant in GGUF_VARIANTS else ec.dtype)
        if key not in refs:
            dtype, _, part = key.partition("/")
            refs[key] = build_reference(our_forward(stored_weights(sd, hf_layout.DTYPES[dtype], bool(part)), cfg), data)
        return refs[key]

    ref = reference("hf")
    reports: list[VariantReport] = []
    sizes: dict[str, int] = {}
    notes: dict[str, Any] = {"reference_ppl": ref.ppl, "skipped": {}, "cast": cast_report(sd, cfg, ec.dtype, data, ref)}
    log(f"export: the cast to {ec.dtype} itself: ppl x{notes['cast']['ppl_ratio']:.4f}, "
        f"logit diff {notes['cast']['max_logit_diff']:.3g} (reported, not gated)")

    def check(variant: str, forward) -> None:
        th = ec.thresholds[variant]
        rep = check_variant(variant, forward, reference(variant), data, th.max_ppl_ratio, th.min_greedy_agreement,
                            th.max_logit_diff)
        log(f"export: {variant}: ppl {rep.ppl:.4g} (x{rep.ppl_ratio:.4f}), greedy agreement {rep.greedy_agreement:.3f}, "
            f"logit diff {rep.max_logit_diff:.3g} -> {'ok' if rep.passed else 'FAILED'}")
        reports.append(rep)

    hf_dir = out_dir / "hf"
    info = hf_layout.write_hf(sd, cfg, hf_dir, dtype=ec.dtype, tokenizer_dir=tokenizer_dir,
                              max_shard_mb=ec.shard_size_mb, moe_architecture=ec.moe_architecture)
    notes["architecture"] = info["architecture"]
    sizes["hf"] = info["bytes"]
    check("hf", transformers_forward(hf_dir))

    for variant in ec.variants:
        t0 = time.perf_counter()
        vdir = out_dir / "quantized" / variant
        if variant in GGUF_VARIANTS:
            try:
                check_supported(cfg)
            except GGUFUnsupported as exc:
                notes["skipped"][variant] = str(exc)
                log(f"export: {variant}: skipped ({exc})")
                continue
            path = vdir / "model.gguf"
            sizes[variant] = write_gguf(sd, cfg, path, variant, tokenizer_dir)["bytes"]
            hf_layout.copy_tokenizer(tokenizer_dir, vdir)
            check(variant, gguf_forward(path, cfg))
        else:
            src, note = sd, None
            if variant == "int4-awq":
                from .awq import awq_scale

                src, losses = awq_scale(sd, cfg, calib, ec.int4_group_size, ec.awq_grid)
                note = {"awq_calibration_rows": int(calib.shape[0]), **losses}
                notes["awq"] = losses
            scheme = "int4" if variant.startswith("int4") else variant
            sizes[variant] = write_quantized_folder(src, cfg, vdir, scheme, ec.dtype, ec.int4_group_size,
                                                    ec.fp8_activations, tokenizer_dir, ec.shard_size_mb,
                                                    ec.moe_architecture, note)
            check(variant, folder_forward(vdir))
        notes.setdefault("seconds", {})[variant] = round(time.perf_counter() - t0, 2)
    return reports, sizes, notes


def export_lineage(inputs: dict[str, Any], earlier: list[tuple[str, str]], shipped: tuple[str, str],
                   shipped_sd: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, ec, tokenizer_dir: Path | None,
                   data: CheckData, sizes: dict[str, int],
                   log=print) -> tuple[list[VariantReport], dict[str, dict[str, Any]]]:
    """<step>/hf for each earlier model of the chain, each checked like hf/ against its own trained weights
    (the `hf` thresholds), so a conversion bug in any row of the evaluation table fails here first; and
    each post-train step's LoRA adapter beside the model it started from. Each model is loaded once."""
    reports: list[VariantReport] = []
    adapters: dict[str, dict[str, Any]] = {}
    th = ec.thresholds["hf"]
    loaded: dict[str, dict[str, torch.Tensor]] = {}  # short name -> weights, for the adapters' base models
    for name, short in [*earlier, shipped]:
        if (name, short) == shipped:
            sd = shipped_sd
        else:
            sd = complete_state_dict(load_full_state_dict(find_checkpoint(inputs[name])), cfg)
            folder = out / short / "hf"
            sizes[short] = hf_layout.write_hf(sd, cfg, folder, dtype=ec.dtype, tokenizer_dir=tokenizer_dir,
                                              max_shard_mb=ec.shard_size_mb, moe_architecture=ec.moe_architecture)["bytes"]
            mdata = for_model(data, short)
            ref = build_reference(our_forward(stored_weights(sd, hf_layout.DTYPES[ec.dtype]), cfg), mdata)
            rep = check_variant(short, transformers_forward(folder), ref, mdata, th.max_ppl_ratio,
                                th.min_greedy_agreement, th.max_logit_diff)
            log(f"export: {short}/hf: ppl {rep.ppl:.4g}, logit diff {rep.max_logit_diff:.3g} -> "
                f"{'ok' if rep.passed else 'FAILED'}")
            reports.append(rep)
        parent = PARENT.get(short)
        if parent in loaded:
            adapter = export_adapter(Path(inputs[name]), short, parent, loaded[parent], sd, cfg, out)
            if adapter is not None:
                adapters[short] = adapter
        if short in PARENT.values():
            loaded[short] = sd
    return reports, adapters


def registry_entries(inputs: dict[str, Any], input_uris: dict[str, str], source: str, source_short: str,
                     earlier: list[tuple[str, str]], ec, out: Path, ckpt: Path) -> list:
    """What becomes a model version: the shipped hf/, each earlier model of the chain exported beside it, and
    each quantized variant written (a skipped one has no folder), each with the checkpoint it came from:
    named by its place in the store (what any node can read), not this machine's download of it."""
    from .registry import ExportedModel, checkpoint_step

    def of(checkpoint: Path, name: str) -> dict[str, str]:
        step = checkpoint_step(checkpoint)
        where = str(checkpoint)
        if name in input_uris and Path(checkpoint).is_relative_to(inputs[name]):
            where = f"{input_uris[name].rstrip('/')}/{Path(checkpoint).relative_to(inputs[name]).as_posix()}"
        return {"checkpoint": where, "checkpoint_step": "" if step is None else str(step)}

    entries = [ExportedModel("hf", source_short, "shipped", source_short, of(ckpt, source))]
    for name, short in earlier:
        if (out / short / "hf").is_dir():
            entries.append(ExportedModel(f"{short}/hf", short, "lineage", short,
                                         of(find_checkpoint(inputs[name]), name)))
    for variant in ec.variants:
        if (out / "quantized" / variant).is_dir():
            entries.append(ExportedModel(f"quantized/{variant}", variant, "quantized", source_short, of(ckpt, source)))
    return entries


def run(ctx: StageContext) -> dict[str, Any]:
    cfg, ec = ctx.cfg, ctx.cfg.export
    out = Path(ctx.out_dir)
    if "tokens" not in ctx.inputs:
        raise ValueError(f"the export stage needs a 'tokens' input; got {sorted(ctx.inputs)}")
    (source, source_short), earlier = model_chain(ctx.inputs, ec.source)
    tokenizer_dir = Path(ctx.inputs["tokenizer"]) if "tokenizer" in ctx.inputs else None
    ckpt = find_checkpoint(ctx.inputs[source])
    sd = complete_state_dict(load_full_state_dict(ckpt), cfg.model)  # optimizer state never read
    val, calib = validation_rows(Path(ctx.inputs["tokens"]), ec.validation_rows, ec.awq_calibration_rows,
                                 ec.validation_seq_len)
    chat = None
    if tokenizer_dir is not None and ec.chat_validation_rows:
        from ..posttrain.data import heldout_chat_rows

        chat = heldout_chat_rows(tokenizer_dir, cfg.posttrain.task, ec.chat_validation_rows, val.shape[1], cfg.seed)
    data = CheckData(val, encode_prompts(tokenizer_dir, ec.prompts, val), ec.greedy_tokens, chat_rows=chat)
    ctx.log_params({"export.source": source, "export.checkpoint": str(ckpt), "export.variants": ",".join(ec.variants),
                    "export.dtype": ec.dtype, "export.lineage": ",".join(s for _, s in earlier) if ec.lineage else ""})

    reports, sizes, notes = export_variants(sd, cfg.model, out, ec, tokenizer_dir, for_model(data, source_short), calib)
    adapters: dict[str, dict[str, Any]] = {}  # an adapter ships only beside the model it applies to (lineage)
    if ec.lineage:
        lineage_reports, adapters = export_lineage(ctx.inputs, earlier, (source, source_short), sd, cfg.model, out,
                                                   ec, tokenizer_dir, data, sizes)
        reports += lineage_reports
    (out / "validation.json").write_text(json.dumps(
        {"reference_ppl": notes["reference_ppl"], "variants": [r.as_dict() for r in reports],
         "skipped": notes["skipped"], "awq": notes.get("awq"), "cast": notes["cast"],
         "chat_rows": 0 if data.chat_rows is None else int(data.chat_rows.shape[0])}, indent=2))

    tables = {cfg.name: size_rows(cfg.model, [v for v in ec.variants if v in sizes], ec.dtype, ec.int4_group_size, sizes)}
    if SEED_CONFIG.is_file() and cfg.name != "seed-1b":
        from infra.config import load_config

        tables["seed-1b (from shapes)"] = size_rows(load_config(SEED_CONFIG).model, list(ec.variants), ec.dtype,
                                                    ec.int4_group_size)
    (out / "size_table.json").write_text(json.dumps(tables, indent=2))
    (out / "size_table.md").write_text(markdown(tables))

    for r in reports:
        ctx.log_metrics({f"export.{r.variant}.ppl": r.ppl, f"export.{r.variant}.ppl_ratio": r.ppl_ratio,
                         f"export.{r.variant}.greedy_agreement": r.greedy_agreement,
                         f"export.{r.variant}.logit_diff": r.max_logit_diff,
                         f"export.{r.variant}.bytes": float(sizes.get(r.variant, 0))}, None)
    ctx.log_artifact(out / "validation.json")
    ctx.log_artifact(out / "size_table.md")
    enforce(reports)  # after the report is written: a failure names the variant and the metric

    registered = None
    if ec.register_model and ctx.run_id:
        from .registry import register_variants

        registered = register_variants(ctx.workspace.tracking_uri, ctx.run_id, out, ec.registered_model_name or cfg.name,
                                       registry_entries(ctx.inputs, ctx.input_uris, source, source_short, earlier, ec, out, ckpt),
                                       tags={"architecture": notes["architecture"]}, artifact_root=ctx.out_uri)
    summary = {"architecture": notes["architecture"], "source": source, "source_step": source_short,
               "lineage": {short: f"{short}/hf" for _, short in earlier} if ec.lineage else {},
               "adapters": adapters, "checkpoint": str(ckpt), "registered": registered,
               "reference_ppl": notes["reference_ppl"], "skipped": notes["skipped"], "sizes": sizes}
    (out / "export.json").write_text(json.dumps(summary, indent=2, default=str))
    figures: dict[str, Any] = {"source": source, "architecture": notes["architecture"],
                               "reference_ppl": round(notes["reference_ppl"], 4),
                               "hf_bytes": sizes.get("hf")}
    for r in reports:
        figures[f"{r.variant}_ppl_ratio"] = round(r.ppl_ratio, 4)
    if registered:
        figures["registered_version"] = registered["version"]
        figures["registered_versions"] = len(registered["versions"])
    return figures
