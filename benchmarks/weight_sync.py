"""GRPO's weight sync into the running rollout engine: today's full reload (every tensor converted to the
Hugging Face layout and loaded, the fused qkv/gate_up rebuilt) against the in-place copy of the tensors a
step changed (all trainable weights in full fine-tuning; the adapted projections' merged weights with LoRA),
and, with LoRA, the adapter alone (PEFT's config and tensors, in memory, loaded as the engine's LoRA adapter,
as vLLM's load_lora_adapter with load_inplace; `lora_adapter_files` writes and reads PEFT's files on the way).
Times the whole push as the trainer makes it (ServingEngineRollouts.update_weights), on random weights of
the tiny config and of a wider model. Prints one JSON line per model and mode, with the median over
`--repeats` pushes and the ratio against the full reload measured in the same run.

    python benchmarks/weight_sync.py [--repeats 7] [--wide-dim 768 --wide-layers 12]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from infra.config import load_config
from stages.posttrain.rollout import ServingEngineRollouts
from trainer.lora import adapter_state_dict, apply_lora, lora_modules, peft_config, save_peft
from trainer.model import Transformer


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def word_tokenizer(vocab: int, folder: Path) -> Path:
    """A word-level tokenizer of `vocab` ids (the engine loads one; nothing here decodes)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1").save_pretrained(folder)
    return folder


def measure(name: str, model_cfg, repeats: int, work: Path) -> list[dict]:
    torch.manual_seed(0)
    model = Transformer(model_cfg)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = ServingEngineRollouts(model_cfg=model_cfg, state_dict=full, workdir=work / name, stop_token_ids=[],
                                   tokenizer_dir=word_tokenizer(model_cfg.vocab_size, work / f"{name}-tok"))
    inner = engine.engine.model

    def full_reload() -> None:  # what every GRPO step did before the in-place copy
        from stages.export import hf as hf_layout

        inner.load_weights(hf_layout.to_hf_state_dict(full, model_cfg, engine.arch, torch.float32))

    apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    adapted = {f"{n}.weight": (m.weight + m.delta_weight()).detach() for n, m in lora_modules(model).items()}
    folder = work / f"{name}-adapter"
    tensors = {"full_reload": len(full), "in_place_all": len(full), "in_place_lora_targets": len(adapted),
               "lora_adapter": len(adapter_state_dict(model)), "lora_adapter_files": len(adapter_state_dict(model))}
    rows, base = [], _median_s(full_reload, repeats)
    for mode, push in (("full_reload", full_reload), ("in_place_all", lambda: engine.update_weights(full)),
                       ("in_place_lora_targets", lambda: engine.update_weights(adapted)),
                       ("lora_adapter", lambda: engine.load_adapter((peft_config(model), adapter_state_dict(model)))),
                       ("lora_adapter_files", lambda: engine.load_adapter(save_peft(model, folder)))):
        s = base if mode == "full_reload" else _median_s(push, repeats)
        rows.append({"benchmark": "weight_sync", "model": name, "params_m": round(sum(v.numel() for v in full.values()) / 1e6, 2),
                     "mode": mode, "tensors": tensors[mode],
                     "median_ms": round(s * 1e3, 2), "speedup_vs_full_reload": round(base / s, 2)})
    return rows


def main() -> None:
    logging.getLogger("stages.serve").setLevel(logging.ERROR)  # the KV budget's notes on a cache this run never uses
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--wide-dim", type=int, default=768)
    ap.add_argument("--wide-layers", type=int, default=12)
    args = ap.parse_args()
    tiny = load_config("tiny").model
    wide = tiny.model_copy(update={"dim": args.wide_dim, "n_layers": args.wide_layers, "n_heads": args.wide_dim // 64,
                                   "n_kv_heads": args.wide_dim // 128, "ffn_dim": 4 * args.wide_dim})
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in (("tiny", tiny), (f"d{args.wide_dim}-l{args.wide_layers}", wide)):
            for row in measure(name, cfg, args.repeats, Path(tmp)):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
