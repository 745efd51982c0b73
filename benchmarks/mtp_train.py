"""Multi-token prediction's cost to the main model: train a config with and without MTP on the same
packed tokens, same steps, seed and batches, in one process each, and print the main model's
validation loss of both (JSON lines; the ratio is the figure, issue 27's target: <= 1.02).

    python benchmarks/mtp_train.py TOKENS_URI OUT_DIR [--config tiny] [--depth 1] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from infra.config import load_config
from infra.launch.job import JobSpec
from trainer.trainer import Trainer


def train(config: str, overrides: list[str], tokens: str, out: Path, tag: str) -> dict:
    cfg = load_config(config, overrides)
    out.mkdir(parents=True, exist_ok=True)
    spec = JobSpec(job_id=f"mtp-{tag}", stage="pretrain", config=cfg.model_dump(mode="json"),
                   inputs={"tokens": tokens}, output=(out / tag).resolve().as_uri(), workdir=str(out / f"{tag}-work"),
                   resume="none")
    t0 = time.perf_counter()
    result = Trainer(spec).run()
    m = result.metrics
    return {"run": tag, "status": result.status, "steps": result.steps, "val_loss": m.get("val_loss"),
            "loss": m.get("loss"), **{k: v for k, v in m.items() if k.startswith("mtp_loss")},
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens")
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--only", choices=["base", "mtp"], default=None)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    torch.set_num_threads(1)
    runs = {"base": [*a.set, "model.mtp_depth=0"], "mtp": [*a.set, f"model.mtp_depth={a.depth}"]}
    for tag, ov in runs.items():
        if a.only in (None, tag):
            print(json.dumps(train(a.config, ov, a.tokens, a.out, f"{tag}-d{a.depth if tag == 'mtp' else 0}")), flush=True)


if __name__ == "__main__":
    main()
