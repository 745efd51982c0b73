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
from infra.config.train import TrainConfig
from trainer.data import MicroBatch
from trainer.objectives import LanguageModelling
from trainer.step import train_step
from trainer.metrics import flops_per_token, measure_peak_flops
from trainer.model import Transformer
from trainer.optim import build_optimizer
from trainer.precision import cast_parameters


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
        S, hd = tokens.shape[1], self.cfg.head_size
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(S, dtype=torch.float32), inv)
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
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also time our step with torch.compile per block")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (use with --threads 1 on a shared, busy machine: time "
                         "spent descheduled by other processes is not counted)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_dim=args.ffn, max_seq_len=args.seq)
    train = TrainConfig(steps=1000, seq_len=args.seq, micro_batch_size=args.batch, global_batch_size=args.batch,
                        lr=3e-4, warmup_steps=0, precision=args.precision, grad_clip=1.0)
    device = torch.device("cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()

    rows = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    batch = [MicroBatch(inputs, targets, np.arange(args.batch))]

    ours = Transformer(cfg)
    if args.precision == "bf16":  # as the trainer holds it: bf16 weights, fp32 masters in the optimizer
        cast_parameters(ours, torch.bfloat16)
    ours_opt = build_optimizer(ours, train)
    plain = PlainLlama(cfg)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    hf = hf_model(cfg)
    hf.load_state_dict({k if k.startswith("lm_head") else f"model.{k}": v.float() for k, v in ours.state_dict().items()})
    # As Hugging Face's Trainer builds it: its default `optim` is "adamw_torch_fused" on torch >= 2.8
    # (transformers TrainingArguments), i.e. torch's fused AdamW, the kernel our optimizer uses too.
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    objective = LanguageModelling()
    step_counter = {"ours": 0}

    def run_ours():
        train_step(ours, ours_opt, batch, objective, train, step_counter["ours"], device)
        step_counter["ours"] += 1

    runners = {
        "ours": run_ours,
        "plain": lambda: plain_step(plain, plain_opt, inputs, targets, autocast),
        "hf": lambda: hf_step(hf, hf_opt, inputs, targets, autocast),
    }
    if args.compile:
        from trainer.parallel.compile import apply_compile

        compiled = cast_parameters(Transformer(cfg), dtype)
        compiled.load_state_dict(ours.state_dict())
        apply_compile(compiled)
        compiled_opt = build_optimizer(compiled, train)
        runners["ours_compiled"] = lambda: train_step(compiled, compiled_opt, batch, objective, train, 0, device)
    for _ in range(args.warmup):
        for fn in runners.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for name, fn in runners.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)

    tokens = args.batch * args.seq
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    peak = measure_peak_flops(device, dtype, size=1024, seconds=1.0, clock=clock)
    fpt = flops_per_token(cfg, args.seq)
    result = {
        "benchmark": "train_throughput",
        "precision": args.precision,
        "shape": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "ffn": args.ffn, "vocab": args.vocab, "seq": args.seq, "batch": args.batch},
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "tokens_per_s": round(tps["ours"], 1),
        "plain_tokens_per_s": round(tps["plain"], 1),
        "hf_tokens_per_s": round(tps["hf"], 1),
        "ratio_vs_plain": round(tps["ours"] / tps["plain"], 3),
        "ratio_vs_hf": round(tps["ours"] / tps["hf"], 3),
        "mfu": round(fpt * tps["ours"] / peak, 4),
        "plain_mfu": round(fpt * tps["plain"] / peak, 4),
        "hf_mfu": round(fpt * tps["hf"] / peak, 4),
        "peak_matmul_flops": round(peak),
        "flops_per_token": fpt,
        **({"compiled_tokens_per_s": round(tps["ours_compiled"], 1),
            "compiled_ratio_vs_hf": round(tps["ours_compiled"] / tps["hf"], 3)} if args.compile else {}),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "step_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
