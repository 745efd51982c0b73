"""Training-step throughput of our trainer against a minimal plain-PyTorch step and Hugging Face's
LlamaForCausalLM, in one process, on the same shapes and precision (bf16 autocast by default).

Each timed round runs one step of each implementation in turn (ours, plain, hf, ours, ...), so a
change in machine load hits all three alike; figures are medians over the timed rounds after
warm-up. MFU uses the seed's model FLOPs (trainer.metrics.flops_per_token) over the best bf16
matmul FLOP/s measured by a probe at start. Prints one JSON line.

Ours holds its weights as the trainer does under bf16 (bf16 parameters, fp32 masters in the optimizer:
trainer/precision.py). Baselines: the plain step is the shortest one written by hand (torch.optim.AdamW
with its defaults); Hugging Face's model runs as a user gets it (fp32 weights, sdpa attention, the same
autocast, fp32 logits into cross-entropy) with the optimizer its Trainer builds by default (fused AdamW on
torch >= 2.8), so neither side is credited for the optimizer kernel.

bf16 matmuls: on a CPU without bf16 GEMM units (AVX2, no AVX512-BF16/AMX), torch runs a bf16 matmul in a
generic kernel about 40x slower than its fp32 GEMM (measured: 1.9 vs 76 GFLOP/s, 2048x256 @ 256x704), and
since the trainer holds bf16 parameters every step of all three implementations was bound by it (~22 s a
step, ours 1.03x Hugging Face's). Our trainer multiplies bf16 as bf16 hardware does (bf16 operands, exact
products, fp32 sums, the output rounded to bf16), which on such a CPU is an fp32 GEMM of the upcast
operands rounded back (trainer/model/bf16_matmul.py): the same numbers within fp32 summation order, with
weights, activations and gradients still bf16 in memory. Hugging Face's model and the plain step run as a
user gets them: their bf16 matmuls take torch's own path, so on such a CPU the ratio is mostly that GEMM.
On a GPU or a CPU with bf16 units every implementation takes torch's path, and the ratio measures the rest
of the step. The MFU probe times the bf16 GEMM the trainer runs (trainer.metrics.measure_peak_flops).

    python -m benchmarks.train_throughput [--dim 512 --layers 4 --seq 256 --batch 8 --rounds 6]
        [--device cuda] [--precision bf16|fp32|fp8] [--activation-checkpointing full] [--compile] [--no-baselines]

On a GPU (`--device cuda`, benchmarks/gpu/run.sh) every step is timed between torch.cuda.synchronize
calls, MFU divides by the GPU's datasheet peak (trainer.metrics.peak_flops: dense bf16, also under fp8,
as TorchTitan quotes it), peak memory is torch's max allocated, set beside `eightfold estimate`'s figure
for the same shape on one device (`estimate_memory_gb`; compare with --no-baselines and without
--compile, when our model is the only one in memory), and `losses` is our step's loss at every step, so
runs of the same shape in bf16 and fp8 (same initial weights, same batch) give comparable curves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from infra.config.model import ModelConfig
from infra.config.parallel import ParallelConfig
from infra.config.train import TrainConfig
from trainer.data import MicroBatch
from trainer.objectives import LanguageModelling
from trainer.step import train_step
from trainer.metrics import datasheet_peak_flops, flops_per_token, measure_peak_flops, peak_flops, peak_memory_gb
from trainer.model import Transformer
from trainer.optim import build_optimizer
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.compile import apply_compile


# --- the plain step: the shortest correct Llama training step one would write by hand ----------------
class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.n1, self.n2 = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, D = x.shape
        h = self.n1(x)
        q = self.q(h).view(B, S, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(B, S, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(B, S, self.kv_heads, self.hd).transpose(1, 2)

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos.to(t.dtype) + torch.cat((-t2, t1), dim=-1) * sin.to(t.dtype)

        q, k = rope(q), rope(k)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, S, D))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PlainLlama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(PlainBlock(cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        S, hd, dev = tokens.shape[1], self.cfg.head_size, tokens.device
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=dev) / hd))
        ang = torch.outer(torch.arange(S, dtype=torch.float32, device=dev), inv)
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


def plain_step(model, opt, inputs, targets, autocast):
    with autocast():
        logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().item()


def hf_model(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_cache=False,
    )
    hc._attn_implementation = "sdpa"
    return LlamaForCausalLM(hc).train()


def hf_step(model, opt, inputs, targets, autocast):
    with autocast():
        logits = model(input_ids=inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().item()


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def estimate_for(cfg: ModelConfig, train: TrainConfig) -> dict:
    """What `eightfold estimate` predicts for this shape on one device: memory of the busiest rank, step time."""
    from infra.config.schema import LifecycleConfig
    from trainer.estimate.run import estimate_run

    life = LifecycleConfig.model_validate({"model": cfg.model_dump(), "tokenizer": {"vocab_size": cfg.vocab_size},
                                           "pretrain": train.model_dump()})
    e = estimate_run(life)
    return {"estimate_memory_gb": round(e["busiest_rank_bytes"] / 2**30, 3),
            "estimate_breakdown_gb": {k: round(v / 2**30, 3) for k, v in e["busiest_rank_breakdown"].items()},
            "estimate_flops_per_step": e["flops_per_step"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", choices=["bf16", "fp32", "fp8"], default="bf16",
                    help="fp8: our step with torchao float8 linear layers (needs FP8 tensor cores, or --fp8-emulate); "
                         "the baselines stay bf16")
    ap.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    ap.add_argument("--fp8-emulate", action="store_true", help="torchao's emulated float8 (any device; a dry run)")
    ap.add_argument("--activation-checkpointing", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    ap.add_argument("--no-baselines", action="store_true",
                    help="only our step (no plain or Hugging Face step): one model in memory, so peak memory is its own")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also time our step with torch.compile per block")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (aot_eager: graph capture only, a dry run's check)")
    ap.add_argument("--probe-seconds", type=float, default=1.0, help="CPU: how long the matmul peak probe runs")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (use with --threads 1 on a shared, busy machine: time "
                         "spent descheduled by other processes is not counted)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    if args.clock == "cpu" and device.type == "cuda":
        raise SystemExit("--clock cpu times host work only; on CUDA use --clock wall")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_dim=args.ffn, max_seq_len=args.seq)
    train = TrainConfig(steps=1000, seq_len=args.seq, micro_batch_size=args.batch, global_batch_size=args.batch,
                        lr=3e-4, warmup_steps=0, precision=args.precision, grad_clip=1.0,
                        activation_checkpointing=args.activation_checkpointing,
                        fp8={"recipe": args.fp8_recipe, "emulate": args.fp8_emulate})
    dims = build_parallel_dims(ParallelConfig(), device.type)
    low = args.precision != "fp32"

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if low else contextlib.nullcontext()

    rows = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    inputs, targets = rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)
    batch = [MicroBatch(inputs, targets, np.arange(args.batch))]

    def ours_model(compile_: bool) -> nn.Module:
        """As the trainer builds it: on the meta device, then trainer.parallel.parallelize on one device
        (bf16 weights with fp32 masters in the optimizer, float8 linear layers under fp8, checkpointing)
        allocates it there and fills it from seed 0, so every run starts from the same weights."""
        with torch.device("meta"):
            model = Transformer(cfg)
        model = parallelize(model, dims, ParallelConfig(), train, device=device, seed=0)
        if compile_:  # where parallelize would (train.compile), last on one device, with the backend asked
            apply_compile(model, args.compile_backend)
        return model

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ours = ours_model(False)
    ours_opt = build_optimizer(ours, train)
    objective = LanguageModelling()
    losses: dict[str, list[float]] = {"ours": []}

    def run_ours():
        losses["ours"].append(train_step(ours, ours_opt, batch, objective, train, len(losses["ours"]), device).loss)

    runners = {"ours": run_ours}
    if not args.no_baselines:
        plain = PlainLlama(cfg).to(device)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        hf = hf_model(cfg)
        hf.load_state_dict({k if k.startswith("lm_head") else f"model.{k}": v.float()
                            for k, v in ours.state_dict().items()})
        hf = hf.to(device)
        # As Hugging Face's Trainer builds it: its default `optim` is "adamw_torch_fused" on torch >= 2.8
        # (transformers TrainingArguments), i.e. torch's fused AdamW, the kernel our optimizer uses too.
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        runners["plain"] = lambda: plain_step(plain, plain_opt, inputs, targets, autocast)
        runners["hf"] = lambda: hf_step(hf, hf_opt, inputs, targets, autocast)
    if args.compile:
        compiled = ours_model(True)
        compiled_opt = build_optimizer(compiled, train)
        losses["ours_compiled"] = []
        runners["ours_compiled"] = lambda: losses["ours_compiled"].append(
            train_step(compiled, compiled_opt, batch, objective, train, len(losses["ours_compiled"]), device).loss)
    for _ in range(args.warmup):
        for fn in runners.values():
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for name, fn in runners.items():
            sync()
            t0 = clock()
            fn()
            sync()
            times[name].append(clock() - t0)

    tokens = args.batch * args.seq
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    if device.type == "cuda":
        peak = peak_flops(device, args.precision)
    else:
        peak = measure_peak_flops(device, torch.bfloat16 if low else torch.float32, size=1024, seconds=args.probe_seconds,
                                  clock=clock)
    fpt = flops_per_token(cfg, args.seq)
    result = {
        "benchmark": "train_throughput",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": args.precision,
        **({"fp8_recipe": args.fp8_recipe, "fp8_emulate": args.fp8_emulate} if args.precision == "fp8" else {}),
        "activation_checkpointing": args.activation_checkpointing,
        "shape": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "ffn": args.ffn, "vocab": args.vocab, "seq": args.seq, "batch": args.batch},
        "params": sum(p.numel() for p in ours.parameters()),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "tokens_per_s": round(tps["ours"], 1),
        "mfu": round(fpt * tps["ours"] / peak, 4),
        "peak_flops": round(peak),
        "peak_flops_source": "datasheet" if device.type == "cuda" and args.precision != "fp32"
                             and datasheet_peak_flops(torch.cuda.get_device_name(device)) else "measured",
        "flops_per_token": fpt,
        "losses": [round(x, 5) for x in losses["ours"]],
        **({"plain_tokens_per_s": round(tps["plain"], 1), "hf_tokens_per_s": round(tps["hf"], 1),
            "ratio_vs_plain": round(tps["ours"] / tps["plain"], 3), "ratio_vs_hf": round(tps["ours"] / tps["hf"], 3),
            "plain_mfu": round(fpt * tps["plain"] / peak, 4), "hf_mfu": round(fpt * tps["hf"] / peak, 4)}
           if not args.no_baselines else {}),
        **({"compile_backend": args.compile_backend, "compiled_tokens_per_s": round(tps["ours_compiled"], 1),
            "compiled_mfu": round(fpt * tps["ours_compiled"] / peak, 4),
            "compiled_speedup": round(tps["ours_compiled"] / tps["ours"], 3),
            "compiled_losses": [round(x, 5) for x in losses["ours_compiled"]],
            **({"compiled_ratio_vs_hf": round(tps["ours_compiled"] / tps["hf"], 3)} if not args.no_baselines else {})}
           if args.compile else {}),
        "models_in_memory": len(runners),
        "peak_memory_gb": round(peak_memory_gb(device), 3),
        **estimate_for(cfg, train),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "step_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
