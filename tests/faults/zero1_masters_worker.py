"""Run on 2 ranks by test_faults_zero1_masters.py: ZeRO-1 over dp=2 on a bf16 model, whose fp32 masters
are copies (the trainer's coming bf16 parameters), checkpointed by the Checkpointer and reloaded.

- bf16 ZeRO-1 -> fresh bf16 ZeRO-1: masters, moments and parameters torch.equal;
- fp32 plain AdamW -> bf16 ZeRO-1: the checkpoint has no masters, so they come from its fp32 weights,
  exactly (not from the bf16 parameters);
- each rank writes its segments' masters to OUT/rankR.pt, for the test to compare with the masters of
  the checkpoint read back by DCP alone in one process (their global offsets).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from infra.config.parallel import ParallelConfig
from infra.config.train import CheckpointConfig, TrainConfig
from infra.store import FileStore
from trainer.checkpoint import Checkpointer
from trainer.parallel import build_parallel_dims
from trainer.parallel.zero1 import DistributedOptimizer

CFG = TrainConfig(lr=1e-2)


def model(dtype) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and every call
    return nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3)).to(dtype)


def train(m: nn.Module, opt, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        x = torch.randn(4, 7, dtype=next(m.parameters()).dtype)
        m(x).float().square().mean().backward()
        if isinstance(opt, DistributedOptimizer):
            opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def zero1(m: nn.Module, dims) -> DistributedOptimizer:
    return DistributedOptimizer(m, CFG, dims, bucket_mb=60 / 2**20)  # small buckets: params cut across ranks


def checkpointer(root: Path) -> Checkpointer:
    ck = Checkpointer(FileStore(root / "store"), CheckpointConfig(), root / "staging", {"dp": 2},
                      log=lambda msg: None)
    OPEN.append(ck)
    return ck


OPEN: list[Checkpointer] = []


def main(out: str) -> None:
    dist.init_process_group("gloo")
    out_dir = Path(out)
    rank = dist.get_rank()
    dims = build_parallel_dims(ParallelConfig(dp=2, zero=1, nproc_per_node=2), "cpu")

    a = model(torch.bfloat16)
    opt_a = zero1(a, dims)
    assert opt_a.own_masters and all(s.own_master for s in opt_a._all_segments())
    train(a, opt_a, 3)
    ck = checkpointer(out_dir / "bf16")
    ck.save(3, a, opt_a, {"step": 3})  # asynchronous: staged, then written in the background
    ck.wait()
    torch.save({opt_a.fqns[s.name]: (s.start, s.master.clone()) for s in opt_a._all_segments()},
               out_dir / f"rank{rank}.pt")

    b = model(torch.bfloat16)
    opt_b = zero1(b, dims)
    assert checkpointer(out_dir / "bf16").load_latest(b, opt_b)["step"] == 3
    for sa, sb in zip(opt_a._all_segments(), opt_b._all_segments()):
        assert torch.equal(sa.master, sb.master), sa.name
        for k, v in opt_a.inner.state[sa.master].items():
            assert torch.equal(v, opt_b.inner.state[sb.master][k]), (sa.name, k)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    # both continue alike
    train(a, opt_a, 1)
    train(b, opt_b, 1)
    for sa, sb in zip(opt_a._all_segments(), opt_b._all_segments()):
        assert torch.equal(sa.master, sb.master), sa.name

    plain = model(torch.float32)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=CFG.lr)
    train(plain, opt_p, 2)
    ck = checkpointer(out_dir / "plain")
    ck.save(2, plain, opt_p, {"step": 2})
    ck.wait()
    c = model(torch.bfloat16)
    opt_c = zero1(c, dims)
    checkpointer(out_dir / "plain").load_latest(c, opt_c)
    weights = dict(plain.named_parameters())
    rounded = 0
    for s in opt_c._all_segments():
        exact = weights[opt_c.fqns[s.name]].detach().reshape(-1)[s.start:s.start + s.length]
        assert torch.equal(s.master, exact), s.name
        rounded += int((exact.bfloat16().float() != exact).sum())
        assert torch.equal(opt_c.inner.state[s.master]["exp_avg"],
                           opt_p.state[weights[opt_c.fqns[s.name]]]["exp_avg"].reshape(-1)[s.start:s.start + s.length])
    total = torch.tensor([rounded])
    dist.all_reduce(total)
    assert int(total) > 0, "every fp32 weight is a bf16 number: the test could not tell the masters' source"
    for ck in OPEN:
        ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
