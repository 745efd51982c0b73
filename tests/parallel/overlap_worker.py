"""Run under torchrun by test_overlap.py: trains a tiny model a few steps per case and records, per rank,
one event log in issue order: the step and micro-batch starts, each unit's forward, every parameter's
gradient arriving (autograd's post-accumulate hook, registered before the optimizer's so a gradient is
logged before anything it triggers), every collective as it is issued (the comm accounting's dispatch
mode), the pipeline's backward passes, and ZeRO-1's waits for gathered weights; plus the losses and the
final weights, to compare overlapped runs with non-overlapped ones bit for bit.

    python -m torch.distributed.run --nproc-per-node=W overlap_worker.py OUT.pt CASE [CASE ...]
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from trainer.data import MicroBatch
from trainer.meta_init import build_model
from trainer.objectives import LanguageModelling
from trainer.parallel.ddp import unwrap
from trainer.step import train_step
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.comm_accounting import CommCounter
from trainer.parallel.grad_all_reduce import GradAllReduce
from trainer.parallel.zero1 import DistributedOptimizer, build_parallel_optimizer

VOCAB, SEQ, MICRO, STEPS = 320, 16, 2, 4
EVENTS: list[tuple] = []

# name -> (parallel, pretrain overrides, overlap on)
CASES = {
    "zero1": ({"dp": 2, "zero": 1}, {}, True),
    "zero1_off": ({"dp": 2, "zero": 1}, {}, False),
    "zero1_bf16": ({"dp": 2, "zero": 1}, {"precision": "bf16"}, True),
    "zero1_bf16_off": ({"dp": 2, "zero": 1}, {"precision": "bf16"}, False),
    "zero1_fp32acc": ({"dp": 2, "zero": 1}, {"precision": "bf16", "fp32_grad_accum": True}, True),
    "zero1_fp32acc_off": ({"dp": 2, "zero": 1}, {"precision": "bf16", "fp32_grad_accum": True}, False),
    "pp_zero1": ({"dp": 2, "pp": 2, "zero": 1, "pp_schedule": "1f1b"}, {}, True),
    "pp_zero1_off": ({"dp": 2, "pp": 2, "zero": 1, "pp_schedule": "1f1b"}, {}, False),
    "pp_zero0": ({"dp": 2, "pp": 2, "zero": 0, "pp_schedule": "1f1b"}, {}, True),
    "pp_zero0_off": ({"dp": 2, "pp": 2, "zero": 0, "pp_schedule": "1f1b"}, {}, False),
}


def world_of(name: str) -> int:
    p = CASES[name][0]
    return p.get("dp", 1) * p.get("pp", 1)


def global_batch(name: str) -> int:
    return 16 if "pp" in CASES[name][0] else 8  # 4 micro-batches per pipeline replica, 2 per dp rank otherwise


def config(name: str) -> LifecycleConfig:
    parallel, train, _ = CASES[name]
    return LifecycleConfig.model_validate({
        "name": "overlap", "seed": 0,
        "model": {"vocab_size": VOCAB, "dim": 48, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                  "max_seq_len": 32},
        "tokenizer": {"vocab_size": VOCAB},
        # 0.02 MB: buckets of 5242 fp32 elements, several per model (and per pipeline stage)
        "parallel": {"nproc_per_node": world_of(name), "bucket_mb": 0.02, **parallel},
        "pretrain": {"steps": STEPS, "seq_len": SEQ, "micro_batch_size": MICRO, "global_batch_size": global_batch(name),
                     "lr": 1e-2, "warmup_steps": 1, "optimizer": "adamw", "precision": "fp32", "grad_clip": 1.0,
                     "peak_flops": 1e11, **train},
    })


def micro_batches(name: str, step: int, dp_rank: int, dp: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(1000 + step)
    n = global_batch(name)
    rows = (torch.randint(0, VOCAB, (n, 1), generator=g)
            + torch.randint(1, 4, (n, SEQ + 1), generator=g).cumsum(1)) % VOCAB
    mine = rows[dp_rank * (n // dp):(dp_rank + 1) * (n // dp)]
    return [MicroBatch(inputs=mine[i:i + MICRO, :-1], targets=mine[i:i + MICRO, 1:], rows=None)
            for i in range(0, len(mine), MICRO)]


class EventLog(CommCounter):
    """The comm accounting, also appending each collective to EVENTS when it is issued."""

    def _record(self, name, args, kwargs) -> None:
        n = len(self.records)
        super()._record(name, args, kwargs)
        if len(self.records) > n:
            r = self.records[-1]
            EVENTS.append(("collective", r.kind, r.dim, r.elements))


def _logged_finish_param_sync(original):
    def finish_param_sync(self, indices=None):
        for i in (sorted(self._param_sync) if indices is None else indices):
            if i in self._param_sync:
                EVENTS.append(("wait", i))
        original(self, indices)

    return finish_param_sync


DistributedOptimizer.finish_param_sync = _logged_finish_param_sync(DistributedOptimizer.finish_param_sync)
_start_after = GradAllReduce.start_after


def instrument(model) -> None:
    """Hooks that log, registered before the optimizer's own."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, name=name: EVENTS.append(("grad", name)))
    units = [("embed_tokens", model.embed_tokens), ("norm", model.norm)]
    units += [(f"layers.{k}", m) for k, m in model.layers.items()]
    for name, m in units:
        if m is not None:
            m.register_forward_pre_hook(lambda mod, args, name=name: EVENTS.append(("forward", name)))
    pipe = getattr(model, "pipeline", None)
    if pipe is None:
        model.register_forward_pre_hook(lambda mod, args: EVENTS.append(("micro",)))
        return
    for stage in pipe.stages:
        def backward_one_chunk(chunk_id, *args, _bwd=stage.backward_one_chunk, **kwargs):
            EVENTS.append(("backward", chunk_id, "start"))
            out = _bwd(chunk_id, *args, **kwargs)
            EVENTS.append(("backward", chunk_id, "end"))
            return out

        stage.backward_one_chunk = backward_one_chunk


def run(name: str) -> dict:
    cfg = config(name)
    t = cfg.pretrain
    overlap = CASES[name][2]
    dims = build_parallel_dims(cfg.parallel, "cpu")
    model = parallelize(build_model(cfg, torch.device("cpu"), cfg.seed), dims, cfg.parallel, t)
    instrument(unwrap(model))
    if cfg.parallel.zero == 1:
        opt = DistributedOptimizer(unwrap(model), t, dims, cfg.parallel.bucket_mb, overlap_grad_reduce=overlap,
                                   overlap_param_gather=overlap)
        buckets = [[n for n, _, _ in b.params] for b in opt.buckets]
    else:
        opt = build_parallel_optimizer(unwrap(model), dims, cfg.parallel, t)
        buckets = None
    # zero=0 under the pipeline: without overlap nothing arms the hooks, finish() reduces every bucket
    GradAllReduce.start_after = _start_after if overlap else (lambda self, backwards: None)
    objective = LanguageModelling()
    losses = []
    EVENTS.clear()
    for step in range(STEPS):
        EVENTS.append(("step", step))
        with EventLog(dims.group_names()):
            res = train_step(model, opt, micro_batches(name, step, dims.rank("dp"), dims.dp), objective, t, step,
                             torch.device("cpu"), dims.group("dp"))
        losses.append(res.loss)
    pipe = getattr(unwrap(model), "pipeline", None)
    if pipe is not None and pipe.grad_sync is not None:
        buckets = [[id(p) for p in b] for b in pipe.grad_sync.buckets]
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in unwrap(model).state_dict().items()}
    return {"losses": losses, "state": state, "events": list(EVENTS), "buckets": buckets,
            "pp_rank": dims.rank("pp"), "dp_rank": dims.rank("dp"), "n_micro": len(micro_batches(name, 0, 0, dims.dp))}


def main(out_file: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        results = {n: run(n) for n in names}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        if dist.get_rank() == 0:
            torch.save(gathered, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
