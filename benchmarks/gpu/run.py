"""The single-GPU check (benchmarks/gpu/run.sh): every path one CUDA device can exercise, in one
process, one JSON line per figure into OUTDIR/results.jsonl (also printed). `--dry-run`: the same
parts on CPU with tiny shapes, to prove every import and code path before a GPU is had.

Parts, in order (a part that fails writes {"part", "status": "failed", "error"} and the rest go on):
  environment   torch, CUDA, NCCL and torchao versions, the device, its datasheet peak
  cuda_tests    tests marked `cuda` (tests/trainer/test_cuda.py): flash SDPA in bf16, the fused LM-head
                loss, RMSNorm's backward, MoE routing, document masks, each against its CPU result
  train_*       benchmarks/train_throughput.py on a seed-1b-shaped model (full width, --layers deep) on
                one device: bf16 (tokens/s, MFU, peak memory vs `eightfold estimate`), bf16 with and
                without torch.compile, fp8 (torchao tensorwise, with and without compile) and full
                activation checkpointing; then train_summary (fp8 speed-up and loss curve against bf16)
  serve         benchmarks/serve_throughput.py on a random seed-1b-wide checkpoint: the engine's server
                at concurrency 1, 32 and 128 against Hugging Face generate in static batches of the same
                size on the same GPU and checkpoint (ratio_vs_hf_static), TTFT and TPOT
  trainer_job   the trainer itself (trainer/trainer.py) for 8 steps with async checkpoints, bf16 then fp8
  checkpoint    benchmarks/checkpoint.py: an async save's stall (pinned CPU buffers) against a sync save

    python -m benchmarks.gpu.run OUTDIR [--dry-run] [--layers N] [--only train_bf16,serve] [--serve-model DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# seed-1b (configs/seed-1b.yaml) at full width; depth is what fits the time
SEED_1B = {"dim": 4096, "heads": 32, "kv_heads": 32, "ffn": 11008, "vocab": 32000, "seq": 2048, "batch": 2}
TINY = {"dim": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 512, "seq": 32, "batch": 2}

MULTI_GPU = [
    {"check": "NCCL process groups, DDP, ZeRO-1, FSDP2 (ZeRO-2/3, HSDP), TP+SP, PP, CP, EP on real GPUs",
     "how": "on one node of 8 GPUs: python -m benchmarks.parallel_layouts (it launches torchrun; with CUDA "
            "present every rank takes its GPU and nccl, trainer/parallel/mesh.py pick_device)"},
    {"check": "the seed's 8-GPU layout (dp2 zero1 x tp2 sp x pp2 1f1b) end to end",
     "how": "eightfold run configs/seed-1b.yaml on a node of 8 GPUs (or infra/launch's Slurm/Kubernetes launchers)"},
    {"check": "async checkpoint stall of a ZeRO-1 job, kill-and-restart time over NCCL",
     "how": "python -m benchmarks.checkpoint --device cuda (its zero1 and restart rows launch 2 ranks)"},
    {"check": "fp8 under FSDP2 (float8 all-gather) and pipeline parallel",
     "how": "pretrain.precision: fp8 with parallel.zero: 3, dp_shard > 1, on several GPUs"},
]


def emit(out: Path, record: dict) -> None:
    line = json.dumps(record, default=str)
    print(line, flush=True)
    with open(out, "a") as f:
        f.write(line + "\n")


def environment(ctx) -> list[dict]:
    import torch

    rec = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    try:
        import torchao

        rec["torchao"] = torchao.__version__
    except ImportError as e:
        rec["torchao"] = f"missing: {e}"
    if torch.cuda.is_available():
        from trainer.metrics import datasheet_peak_flops

        name = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        rec.update(device=name, capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   memory_gb=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   nccl=".".join(map(str, v)) if isinstance(v := torch.cuda.nccl.version(), tuple) else str(v),
                   datasheet_bf16_flops=datasheet_peak_flops(name), datasheet_fp8_flops=datasheet_peak_flops(name, fp8=True))
    return [rec]


class _Collect:
    """A pytest plugin that keeps each test's outcome."""

    def __init__(self):
        self.rows: list[dict] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            row = {"test": report.nodeid.split("::")[-1], "outcome": report.outcome, "s": round(report.duration, 3)}
            if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                row["reason"] = report.longrepr[2]
            elif report.outcome == "failed":
                row["error"] = str(report.longrepr).strip().splitlines()[-1][:500]
            self.rows.append(row)


def cuda_tests(ctx) -> list[dict]:
    import pytest

    plugin = _Collect()
    with contextlib.redirect_stdout(io.StringIO()):  # pytest's report would mix with the JSON lines
        rc = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "-m", "cuda", "-o", "addopts=",
                          str(ROOT / "tests" / "trainer" / "test_cuda.py")], plugins=[plugin])
    outcomes = [r["outcome"] for r in plugin.rows]
    return [{"exit_code": int(rc), **({"status": "failed"} if int(rc) != 0 else {}), "passed": outcomes.count("passed"), "failed": outcomes.count("failed"),
             "skipped": outcomes.count("skipped"), "tests": plugin.rows,
             **({"dry_run_note": "no CUDA here: every cuda test skips (collected, imports checked)"} if ctx.dry else {})}]


def train_args(ctx, *extra: str) -> list[str]:
    shape = TINY if ctx.dry else SEED_1B
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    argv += [f"--layers={2 if ctx.dry else ctx.layers}", "--no-baselines", f"--device={ctx.device}",
             f"--warmup={1 if ctx.dry else 3}", f"--rounds={2 if ctx.dry else 8}"]
    if ctx.dry:
        argv += ["--threads=1", "--probe-seconds=0.2"]
    return argv + list(extra)


def _train(ctx, *extra: str) -> dict:
    from benchmarks import train_throughput

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its own line; ours carries the part's name
        rec = train_throughput.main(train_args(ctx, *extra))
    _free()
    return rec


def _dry_compile(ctx) -> list[str]:
    # inductor's code generation is the device's own (Triton kernels on a GPU, C++ on a CPU); the dry run
    # checks the same graph capture, forward and backward, through aot_eager
    return ["--compile", "--compile-backend=aot_eager"] if ctx.dry else ["--compile"]


def _fp8(ctx) -> list[str]:
    return ["--precision=fp8", "--fp8-recipe=tensorwise"] + (["--fp8-emulate"] if ctx.dry else [])


def train_bf16(ctx) -> list[dict]:
    rec = _train(ctx)
    rec["memory_over_estimate"] = rec["peak_memory_gb"] / rec["estimate_memory_gb"]
    return [rec]


def train_bf16_compile(ctx) -> list[dict]:
    rec = _train(ctx, *_dry_compile(ctx))
    return [{**rec, **({"dry_run_note": "compile through aot_eager (no code generation on CPU)"} if ctx.dry else {})}]


def train_fp8(ctx) -> list[dict]:
    rec = _train(ctx, *_fp8(ctx), *_dry_compile(ctx))
    return [{**rec, **({"dry_run_note": "torchao's emulated float8 (no FP8 tensor cores on CPU); compile through "
                                        "aot_eager"} if ctx.dry else {})}]


def train_checkpointing(ctx) -> list[dict]:
    rec = _train(ctx, "--activation-checkpointing=full")
    rec["memory_over_estimate"] = rec["peak_memory_gb"] / rec["estimate_memory_gb"]
    return [rec]


def train_summary(ctx) -> list[dict]:
    """fp8 against bf16 from the runs above: speed-up (eager and compiled) and the loss curves, which
    start from the same weights and see the same batch at every step."""
    bf16, fp8 = ctx.results.get("train_bf16_compile"), ctx.results.get("train_fp8")
    if not bf16 or not fp8:
        return [{"status": "skipped", "reason": "needs train_bf16_compile and train_fp8"}]
    a, b = bf16[0]["losses"], fp8[0]["losses"]
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    out = {"fp8_speedup_eager": fp8[0]["tokens_per_s"] / bf16[0]["tokens_per_s"],
           "fp8_speedup_compiled": fp8[0]["compiled_tokens_per_s"] / bf16[0]["compiled_tokens_per_s"],
           "bf16_mfu": bf16[0]["mfu"], "bf16_compiled_mfu": bf16[0]["compiled_mfu"],
           "fp8_compiled_mfu": fp8[0]["compiled_mfu"], "compile_speedup_bf16": bf16[0]["compiled_speedup"],
           "loss_steps": len(rel), "loss_bf16": a, "loss_fp8": b,
           "loss_rel_diff_max": max(rel), "loss_rel_diff_last": rel[-1],
           "anchors": {"mfu": "Megatron 41-47% (H100), TorchTitan Llama 3 8B 33-39% without float8",
                       "fp8_speedup": "TorchTitan 1.28x on Llama 3 8B"}}
    for name in ("train_bf16", "train_checkpointing"):
        if ctx.results.get(name):
            r = ctx.results[name][0]
            out[f"{name}_peak_memory_gb"], out[f"{name}_estimate_memory_gb"] = r["peak_memory_gb"], r["estimate_memory_gb"]
    return [out]


def trainer_job(ctx) -> list[dict]:
    """The trainer itself (trainer/trainer.py, as `python -m trainer` runs one rank) on byte tokens of the
    standard library, its every other layer a mixture of 4 experts: device pick, datasheet MFU, peak
    memory, the estimator's figures beside a FLOP count, an async checkpoint mid-run and the final one;
    in bf16, then in fp8."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.trainer_data import VOCAB, make_tokens
    from infra.config import LifecycleConfig
    from infra.launch.job import JobSpec
    from trainer.trainer import Trainer

    seq = 32 if ctx.dry else 1024
    tokens = make_tokens(Path(ctx.tmp) / "tokens", seq_len=seq, max_bytes=60_000 if ctx.dry else 400_000)
    shape = ({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128} if ctx.dry else
             {"dim": 1024, "n_layers": 4, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 2816})
    out = []
    # a dry run: bf16 only (torchao's emulated float8 multiplies through CPU bf16 GEMMs, seconds a step here;
    # its trainer path is tests/trainer/test_fp8.py's and the train_fp8 part's)
    for precision in ("bf16",) if ctx.dry else ("bf16", "fp8"):
        cfg = LifecycleConfig.model_validate({
            "name": "gpu-check", "model": {"vocab_size": VOCAB, "max_seq_len": seq, **shape,
                                           "moe": {"num_experts": 4, "top_k": 2, "every": 2}},
            "tokenizer": {"vocab_size": VOCAB}, "infra": {"device": ctx.device},
            "pretrain": {"steps": 2 if ctx.dry else 8, "seq_len": seq, "micro_batch_size": 4, "global_batch_size": 8,
                         "lr": 1e-3, "warmup_steps": 0, "precision": precision, "eval_batches": 1,
                         "checkpoint": {"every": 1 if ctx.dry else 4, "async_save": True}}})
        root = Path(ctx.tmp) / f"job-{precision}"
        spec = JobSpec(job_id=f"gpu-check-{precision}", stage="pretrain", config=cfg.model_dump(mode="json"),
                       inputs={"tokens": str(tokens)}, output=str(root / "out"), workdir=str(root / "work"),
                       resume="none")
        t0 = time.perf_counter()
        result = Trainer(spec).run()
        out.append({"precision": precision, "status": "ok" if result.status == "completed" else "failed",
                    "job_status": result.status, "steps": result.steps, "wall_s": round(time.perf_counter() - t0, 2),
                    "checkpoint": result.checkpoint, "message": result.message,
                    **{k: v for k, v in result.metrics.items() if not k.startswith(("act_", "comm/"))}})
        _free()
    return out


def serve_model(ctx) -> str:
    """A random checkpoint: seed-1b's width and vocabulary, 4 layers (tiny on a dry run), with a BPE
    tokenizer trained on the standard library (stages/serve/testing.py)."""
    if ctx.serve_model:
        return ctx.serve_model
    from stages.serve.testing import make_llama, make_tokenizer

    out = Path(ctx.tmp) / "serve-model"
    out.mkdir(parents=True, exist_ok=True)
    if ctx.dry:
        make_tokenizer(out, vocab_size=512, max_bytes=100_000)
        make_llama(out, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=128, max_position_embeddings=512)
    else:
        make_tokenizer(out, vocab_size=32000)
        make_llama(out, vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=32,
                   intermediate_size=11008, max_position_embeddings=2048)
    return str(out)


def serve(ctx) -> list[dict]:
    from benchmarks import serve_throughput

    model = serve_model(ctx)
    jsonl = Path(ctx.tmp) / "serve.jsonl"
    if ctx.dry:
        argv = [model, "--device=cpu", "--dtype=float32", "--concurrency-sweep", "1", "4", "--num-prompts=4",
                "--input-len=8", "--output-len=4", "--server=thread", "--enforce-eager", "--threads=1"]
    else:
        argv = [model, "--device=cuda", "--dtype=bfloat16", "--kv-cache-memory-gb=24", "--concurrency-sweep", "1",
                "32", "128", "--num-prompts=64", "--input-len=64", "--output-len=64", "--threads=8"]
    argv += ["--baseline", "hf", "--no-speculative", "--no-json-schema", "--no-in-process", "--rounds=1",
             "--sweep-passes=1", f"--out={jsonl}"]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = serve_throughput.main(argv)
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
    note = {"dry_run_note": "server in a thread, decode step eager (no compile, no CUDA graphs)"} if ctx.dry else {}
    bad = {"status": "failed"} if rc != 0 else {}
    return [{"exit_code": rc, **row, **note, **bad} for row in rows] or [{"exit_code": rc, "status": "failed"}]


def checkpoint(ctx) -> list[dict]:
    from benchmarks import checkpoint as ckpt

    argv = ["--no-restart", "--no-zero1", f"--device={ctx.device}"]
    argv += (["--dim=64", "--layers=2", "--vocab=512", "--seq=32", "--rounds=1", "--overlap-steps=1"] if ctx.dry
             else ["--dim=2048", "--layers=4", "--vocab=32000", "--seq=1024", "--batch=4", "--rounds=2"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # its figure lines: the save's, then the summary
        ckpt.main(argv)
    _free()
    return [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("{")]


# In order of what the issue needs most, should the time run out (run.sh holds the run to 8 minutes).
PARTS = {"environment": environment, "cuda_tests": cuda_tests, "train_bf16": train_bf16,
         "train_bf16_compile": train_bf16_compile, "train_fp8": train_fp8, "train_summary": train_summary,
         "serve": serve, "trainer_job": trainer_job, "checkpoint": checkpoint, "train_checkpointing": train_checkpointing}


def _free() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Context:
    def __init__(self, ns):
        import torch

        self.dry = ns.dry_run
        self.layers = ns.layers
        self.serve_model = ns.serve_model
        self.device = "cpu" if self.dry else "cuda"
        if not self.dry and not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu/run.sh: no CUDA device here (use --dry-run on a CPU)")
        self.tmp = tempfile.mkdtemp(prefix="eightfold-gpu-")
        self.results: dict[str, list[dict]] = {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: every import and code path")
    ap.add_argument("--layers", type=int, default=8, help="depth of the seed-1b-wide training model")
    ap.add_argument("--only", default=None, help="comma-separated parts (default: all, in order)")
    ap.add_argument("--serve-model", default=None, help="serve this HF checkpoint folder instead of a random one")
    ns = ap.parse_args(argv)
    parts = ns.only.split(",") if ns.only else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    out_dir = Path(ns.outdir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "results.jsonl"
    ctx = Context(ns)
    emit(out, {"part": "header", "dry_run": ctx.dry, "parts": parts, "needs_several_gpus": MULTI_GPU})
    t_all, failed = time.perf_counter(), []
    for name in parts:
        t0 = time.perf_counter()
        try:
            records = PARTS[name](ctx)
            status = "ok"
        except BaseException as e:  # noqa: BLE001 - one part's failure is recorded; the others still run
            if isinstance(e, KeyboardInterrupt):
                raise
            records = [{"error": f"{type(e).__name__}: {e}".splitlines()[0][:1000],
                        "traceback_tail": traceback.format_exc()[-3000:]}]
            status = "failed"
            failed.append(name)
            _free()
        if status == "ok" and any(r.get("status") == "failed" for r in records):
            failed.append(name)
        ctx.results[name] = records if status == "ok" else []
        elapsed = round(time.perf_counter() - t0, 2)
        for rec in records:
            emit(out, {"part": name, "status": rec.pop("status", status), "dry_run": ctx.dry, "part_s": elapsed, **rec})
    emit(out, {"part": "end", "dry_run": ctx.dry, "failed_parts": failed, "total_s": round(time.perf_counter() - t_all, 1)})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
