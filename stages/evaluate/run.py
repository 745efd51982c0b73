"""Run lm-eval on each model variant, offline: which variants exist in the inputs, one
`lm_eval.simple_evaluate` per variant on the `eightfold` model (the serving engine), and the few
parts of its result worth keeping (metrics, stderr, directions, per-example outputs)."""

from __future__ import annotations

import functools
import json
import math
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.config.evaluate import EvaluateConfig

# Inputs that hold data, not models.
DATA_INPUTS = ("data", "tokens", "tokenizer")


@dataclass
class Variant:
    name: str
    path: Path | None  # None: found but nothing can run it (see `skipped`)
    skipped: str = ""
    base: Path | None = None  # the unquantized folder beside a quantized variant (architecture, tokenizer)


def _is_hf_folder(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _resolve(spec: str, inputs: dict[str, Path]) -> Path:
    if ":" in spec and not Path(spec).is_absolute():
        key, rel = spec.split(":", 1)
        if key not in inputs:
            raise ValueError(f"evaluate.variants path {spec!r}: no input named {key!r} (inputs: {sorted(inputs)})")
        return Path(inputs[key]) / rel
    p = Path(spec).expanduser()
    if not p.is_absolute():
        raise ValueError(f"evaluate.variants path {spec!r}: use '<input>:<relative path>' or an absolute folder")
    return p


def export_summary(root: Path) -> dict[str, Any]:
    """The export stage's export.json in `root` (which step it ships, its lineage), or {}."""
    f = root / "export.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def discover_variants(cfg: EvaluateConfig, inputs: dict[str, Path]) -> list[Variant]:
    """The configured variants, or every model folder in the inputs: `<input>/hf` is named after its
    input (for the `export` input, the step it ships, from export.json's `source_step`, else "hf"),
    `<input>/<step>/hf` is `step` (the export's lineage: pretrain, sft, dpo), `<input>/quantized/<q>` is `q` (`<input>-<q>` for inputs other
    than `export`; a folder holding a GGUF file counts when an hf/ folder sits beside it, which gives
    the architecture and tokenizer), an input that is itself a model folder keeps its name."""
    if cfg.variants:
        out = []
        for v in cfg.variants:
            path = _resolve(v.path, inputs)
            base = path.parent.parent / "hf" if path.parent.name == "quantized" else None
            base = base if base is not None and _is_hf_folder(base) else None
            if not (_is_hf_folder(path) or (base is not None and any(path.glob("*.gguf")))):
                raise ValueError(f"evaluate variant {v.name!r}: {path} is not a Hugging Face model folder "
                                 "(config.json and *.safetensors) or a GGUF folder beside an hf/ folder")
            out.append(Variant(v.name, path, base=base))
        return out
    found: list[Variant] = []
    for key in sorted(inputs):
        if key in DATA_INPUTS:
            continue
        root = Path(inputs[key])
        if _is_hf_folder(root):
            found.append(Variant(key, root))
        # one export per step (e.g. <input>/pretrain/hf, <input>/sft/hf): named after the step, in the
        # lifecycle's order when export.json lists the lineage, then the shipped model (hf/)
        shipped = export_summary(root)
        order = list(shipped.get("lineage", {}))
        steps = [p for p in root.iterdir() if p.is_dir() and p.name not in ("hf", "quantized", "adapters")]
        for step in sorted(steps, key=lambda p: (order.index(p.name) if p.name in order else len(order), p.name)):
            if _is_hf_folder(step / "hf"):
                found.append(Variant(step.name, step / "hf"))
        if _is_hf_folder(root / "hf"):
            # the export stage's hf/ is named after the model it ships (e.g. "grpo") when export.json says
            name = shipped.get("source_step", "hf") if key == "export" else key
            found.append(Variant(name, root / "hf"))
        qdir = root / "quantized"
        base = root / "hf" if _is_hf_folder(root / "hf") else None
        for q in sorted(p for p in qdir.iterdir() if p.is_dir()) if qdir.is_dir() else []:
            name = q.name if key == "export" else f"{key}-{q.name}"
            if _is_hf_folder(q) or (any(q.glob("*.gguf")) and base is not None):
                found.append(Variant(name, q, base=base))
            else:
                files = ", ".join(sorted(f.name for f in q.iterdir())[:3])
                found.append(Variant(name, None, f"neither a Hugging Face folder nor a GGUF file beside an hf/ "
                                                 f"folder ({files})"))
    if not any(v.path for v in found):
        raise ValueError(f"no model folder to evaluate in inputs {sorted(inputs)} (looked for hf/, quantized/*/ "
                         "and model folders); set evaluate.variants")
    return found


# -- one lm-eval run ---------------------------------------------------------------------------------

def offline_env() -> None:
    """lm-eval and datasets must never reach the network: everything is local files."""
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[k] = "1"


def model_args(cfg: EvaluateConfig, path: Path, backend: str | None = None) -> dict[str, Any]:
    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    args: dict[str, Any] = {"pretrained": str(path), "backend": backend or cfg.backend, "batch_size": cfg.batch_size,
                            "max_gen_toks": cfg.max_gen_toks, "dtype": cfg.dtype, "device": device}
    if cfg.max_length:
        args["max_length"] = cfg.max_length
    if (backend or cfg.backend) == "engine":
        args["kv_cache_memory_gb"] = cfg.kv_cache_memory_gb
    return args


@contextmanager
def quiet_request_building():
    """lm-eval draws a progress bar for every task it builds requests for (lm_eval/api/task.py:
    build_all_requests, with no way to turn it off): in a stage's log that is one bar per task and
    variant, each over in milliseconds. Its `tqdm` is swapped for a silent one while we evaluate."""
    import lm_eval.api.task as task_module
    from tqdm import tqdm

    original = task_module.tqdm
    task_module.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = original


def evaluate_model(model: Any, tasks: list[str], task_manager, cfg: EvaluateConfig,
                   model_args: dict[str, Any] | str | None = None) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` on one model (a registered name with args, or an LM object)."""
    import lm_eval

    from . import lm_model  # noqa: F401  registers "eightfold"

    offline_env()
    with quiet_request_building():
        return lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=tasks, task_manager=task_manager, limit=cfg.limit,
            bootstrap_iters=cfg.bootstrap_iters, log_samples=True, apply_chat_template=cfg.apply_chat_template,
            random_seed=cfg.seed, numpy_random_seed=cfg.seed,
            torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed,
        )


def _is_pair(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)


def _corpus_metric(name: str, pairs: list) -> float:
    ll = sum(p[0] for p in pairs)
    n = sum(p[1] for p in pairs)
    if name == "bits_per_byte":
        return -ll / n / math.log(2)
    return math.exp(-ll / n)  # word_perplexity, byte_perplexity (weighted perplexity)


def bootstrap_stderr(name: str, pairs: list, iters: int, seed: int) -> float | None:
    """Stderr of a corpus-level metric (weighted perplexity, bits per byte) by resampling documents,
    where lm-eval reports "N/A"."""
    if iters <= 0 or len(pairs) < 2:
        return None
    rng = random.Random(seed)
    vals = [_corpus_metric(name, [pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(iters)]
    mean = sum(vals) / len(vals)
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def summarize(raw: dict[str, Any], cfg: EvaluateConfig) -> dict[str, Any]:
    """{task: {metric: {"value", "stderr", "stderr_kind", "higher_is_better"}}, "n": {task: examples}}:
    the numbers of an lm-eval result, with bootstrap stderr over documents where lm-eval has none."""
    out: dict[str, Any] = {"metrics": {}, "n": {}}
    hib = raw.get("higher_is_better", {})
    for task, res in raw["results"].items():
        metrics: dict[str, Any] = {}
        for key, value in res.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else key
            se = res.get(f"{metric}_stderr,{filt}")
            kind = "lm-eval"
            if not isinstance(se, (int, float)):
                pairs = [s[metric] for s in raw.get("samples", {}).get(task, []) if _is_pair(s.get(metric))]
                se = bootstrap_stderr(metric, pairs, cfg.bootstrap_iters, cfg.seed)
                kind = "bootstrap over documents" if se is not None else "none"
            metrics[name] = {"value": float(value), "stderr": None if se is None else float(se), "stderr_kind": kind,
                             "higher_is_better": bool(hib.get(task, {}).get(metric, True))}
        out["metrics"][task] = metrics
        out["n"][task] = int(raw.get("n-samples", {}).get(task, {}).get("effective", res.get("sample_len", 0)) or 0)
    return out


def write_samples(raw: dict[str, Any], folder: Path) -> None:
    """Per-example inputs, outputs and scores, one jsonl per task (what a person reads to see why)."""
    folder.mkdir(parents=True, exist_ok=True)
    for task, samples in raw.get("samples", {}).items():
        metrics = {key.split(",")[0] for key in raw["results"].get(task, {}) if "," in key}
        with (folder / f"{task}.jsonl").open("w", encoding="utf-8") as f:
            for s in samples:
                row = {"doc_id": s.get("doc_id"), "target": s.get("target"), "resps": s.get("filtered_resps"),
                       **{k: v for k, v in s.items() if k in metrics}}
                f.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
