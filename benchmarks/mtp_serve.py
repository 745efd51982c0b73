"""MTP speculation on held-out code: export a pretrain output that has MTP modules (the Hugging Face
folder + the mtp.safetensors sidecar), take prompts from the held-out (val) split of the packed tokens,
and time greedy decoding one request at a time, plain vs n-gram vs MTP, beside the ceiling at the same k
(drafts that are the plain greedy output: always accepted, free to make; stages/serve/bench.py
spec_benchmark). Prints JSON lines: spec_speedup, acceptance_rate_first (the first MTP token's) and
identical_greedy per proposer.

    python benchmarks/mtp_serve.py PRETRAIN_OUT TOKENIZER_DIR TOKENS_DIR EXPORT_DIR
        [--config tiny] [--set model.mtp_depth=2] [--prompts 8] [--prompt-len 96] [--output-len 64] [--eager]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from infra.config import load_config
from stages.export.hf import write_hf
from stages.export.merge import complete_state_dict, find_checkpoint, load_full_state_dict
from stages.serve.bench import spec_benchmark


def heldout_prompts(tokens_dir: Path, tokenizer_dir: Path, n: int, length: int) -> list[str]:
    """`n` prompts of `length` tokens, from evenly spaced places of the val split (never trained on)."""
    from tokenizers import Tokenizer

    from trainer.shards import PackedShards

    shards = PackedShards(tokens_dir / "val")
    rows = shards.rows(np.arange(len(shards)))
    flat = np.asarray(rows).reshape(-1)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    step = max(1, (len(flat) - length) // n)
    return [tok.decode(flat[i * step: i * step + length].tolist()) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pretrain_out", type=Path)
    ap.add_argument("tokenizer_dir", type=Path)
    ap.add_argument("tokens_dir", type=Path)
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true",
                    help="plain and speculative engines eager; by default both compile their steps, as served")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config, a.set)
    if not (a.export_dir / "config.json").is_file():
        sd = complete_state_dict(load_full_state_dict(find_checkpoint(a.pretrain_out)), cfg.model)
        write_hf(sd, cfg.model, a.export_dir, dtype="float32", tokenizer_dir=a.tokenizer_dir)
    prompts = heldout_prompts(a.tokens_dir, a.tokenizer_dir, a.prompts, a.prompt_len)
    for d in spec_benchmark(str(a.export_dir), None, len(prompts), a.output_len, a.k, repeats=a.rounds,
                            methods=["ngram", "mtp", "ceiling"], prompts=prompts, enforce_eager=a.eager):
        print(json.dumps({k: v for k, v in d.items() if not k.startswith("rounds_")} | {
            "rounds_spec_speedup": d["rounds_spec_speedup"]}, default=float), flush=True)


if __name__ == "__main__":
    main()
