"""Llama-3-70B's width (configs/presets/llama3-70b.yaml: dim 8192, 64 heads, 8 KV heads, ffn 28672, vocab
128256) with 2 layers, bf16, tp=2 x pp=2: build on meta, parallelise, materialise. Each rank saves what
it holds (names, shapes, local parameter bytes), a few of its rows (to check against the generator
independently), and its memory: peak RSS (getrusage) and RSS now (psutil). Run by test_meta_init.py:

    python -m torch.distributed.run --nproc-per-node=4 meta_70b_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import resource
import sys
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from infra.config import load_config
from trainer.meta_init import build_model
from trainer.parallel.ddp import unwrap
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.materialize import local_shard

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["model.n_layers=2", "parallel.nnodes=1", "parallel.nproc_per_node=4", "parallel.dp=1",
             "parallel.zero=0", "parallel.tp=2", "parallel.pp=2", "parallel.pp_split=[1,1]", "infra.device=cpu"]


def config():
    return load_config(ROOT / "configs/presets/llama3-70b.yaml", OVERRIDES)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    me = psutil.Process()
    try:
        cfg = config()
        dims = build_parallel_dims(cfg.parallel, "cpu")
        rss_before = me.memory_info().rss
        model = unwrap(parallelize(build_model(cfg), dims, cfg.parallel, cfg.pretrain, device=torch.device("cpu"),
                                   seed=cfg.seed))
        params, rows = {}, {}
        for name, p in model.named_parameters():
            local, offset = local_shard(p)
            params[name] = {"shape": list(p.shape), "local_shape": list(local.shape), "offset": list(offset or [0] * p.dim()),
                            "bytes": local.numel() * local.element_size(), "dtype": str(local.dtype),
                            "is_meta": local.is_meta}
            rows[name] = (local[:2].clone(), local[-1:].clone())  # first and last rows, checked by the test
        record = {"rank": rank, "tp_rank": dims.rank("tp"), "pp_rank": dims.rank("pp"), "params": params,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_before": rss_before, "rss_after": me.memory_info().rss}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
        torch.save(rows, Path(out_dir) / f"rows{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
