"""Step metrics: FLOPs per token and MFU (seed: "training FLOPs ~ 6 x parameters x tokens ... less
the embedding ... plus attention"), a matmul probe for the peak when none is configured, peak
memory, and where they go: metrics.jsonl, MLflow (rank 0, through infra.tracking.RunLogger; each
committed checkpoint a LoggedModel there) and a progress bar. Other ranks stay quiet."""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Callable
from pathlib import Path

import torch

from infra.config.model import ModelConfig

from .model import param_counts
from .model.bf16_matmul import mm


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (active parameters - embedding lookup) + 12 x L x S x H_attn.

    The attention term (Megatron, Narayanan et al. 2021) counts QK^T and AV: 2 matmuls x 2 FLOPs x S
    x (heads x head size) per token per layer, x3 for forward + backward, without causal halving as
    the seed does (5 x 2048 x 4096 x 12 x 32768 tokens ~ 16 TFLOP). A tied embedding is also the LM
    head, a real matmul, so it is not subtracted."""
    counts = param_counts(cfg)
    matmul_params = counts["active"] - (0 if cfg.tie_embeddings else counts["embedding"])
    attention = 12 * (cfg.n_layers + cfg.mtp_depth) * seq_len * cfg.n_heads * cfg.head_size
    # MTP: its modules' parameters are in `active`; each depth also runs the shared LM head again
    return 6.0 * (matmul_params + cfg.mtp_depth * cfg.vocab_size * cfg.dim) + attention


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5,
                       clock=time.perf_counter) -> float:
    """Best FLOP/s of a square matmul in `dtype`, as the model multiplies (model/bf16_matmul.py: on a CPU
    without a bf16 GEMM, bf16 runs as an fp32 GEMM of the upcast operands): the roofline the step is
    compared against. `clock` lets a benchmark that times steps in CPU time probe with the same clock."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _sync(device)
        t0 = clock()
        for _ in range(4):
            mm(a, b)
        _sync(device)
        best = max(best, 4 * 2 * size**3 / max(clock() - t0, 1e-9))
    return best


# Dense (no sparsity) peak tensor FLOP/s per GPU from NVIDIA's datasheets, (bf16, fp8), matched on
# torch.cuda.get_device_name, most specific first: what MFU is quoted against (Megatron's 41-47% on H100,
# TorchTitan's 33-39% on Llama 3 8B). H200 has H100 SXM's compute (989 / 1979 TFLOP/s), more memory.
DATASHEET_PEAK_FLOPS = (
    ("H100 PCIe", 756e12, 1513e12),
    ("H100 NVL", 835e12, 1671e12),
    ("H100", 989e12, 1979e12),
    ("H200", 989e12, 1979e12),
    ("GH200", 989e12, 1979e12),
    ("B200", 2250e12, 4500e12),
    ("L40S", 362e12, 733e12),
    ("A100", 312e12, None),
)


def datasheet_peak_flops(device_name: str, fp8: bool = False) -> float | None:
    """The datasheet's dense bf16 (or fp8) peak for `device_name`; None when the device is not listed,
    or has no FP8 tensor cores. MFU under precision fp8 is quoted against the bf16 peak, as TorchTitan
    quotes it: the model's FLOPs are the same, and a faster step shows as a higher MFU."""
    for key, bf16, fp8_peak in DATASHEET_PEAK_FLOPS:
        if key in device_name:
            return fp8_peak if fp8 else bf16
    return None


def peak_flops(device: torch.device, precision: str) -> float:
    """The peak MFU divides by: the datasheet's bf16 figure on a listed GPU, else a matmul probe (a CPU:
    the best it measures; 8192-square on an unlisted GPU, where 1024 would not fill it)."""
    if device.type == "cuda" and precision != "fp32":
        known = datasheet_peak_flops(torch.cuda.get_device_name(device))
        if known:
            return known
    dtype = torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32
    return measure_peak_flops(device, dtype, size=8192 if device.type == "cuda" else 1024)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device: torch.device) -> float:
    """CUDA max allocated, or this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kb / 2**20


class MetricsSink:
    """Where rank 0's metrics go. Non-zero ranks get a sink that drops everything."""

    def __init__(self, out_dir: Path | None, tracking_uri: str | None, run_id: str | None,
                 total_steps: int, enabled: bool, progress: bool = True,
                 sync: Callable[[bool], None] | None = None, system_metrics_s: float | None = None):
        """`sync(force)`: called after each write (and forced at close) to mirror metrics.jsonl to a
        remote output (trainer.job_io.OutputFolder.sync). `system_metrics_s`: MLflow's own system
        metrics monitor samples this machine every so many seconds into the run (system/*), continuing
        the steps of an earlier attempt."""
        self.enabled = enabled
        self._sync = sync
        self._jsonl = None
        self._logger = None
        self._bar = None
        self._system = None
        if not enabled:
            return
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(out_dir / "metrics.jsonl", "a")
        if tracking_uri and run_id:
            try:
                from infra.tracking import RunLogger
            except ImportError:  # tracking module not present: keep training, say so once
                print("trainer: infra.tracking is not available; metrics go to metrics.jsonl only", file=sys.stderr)
            else:
                self._logger = RunLogger(tracking_uri, run_id)
                if system_metrics_s:
                    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                    self._system = SystemMetricsMonitor(run_id, sampling_interval=system_metrics_s,
                                                        resume_logging=True, tracking_uri=tracking_uri)
                    self._system.start()
        if progress:
            from infra.progress import progress_bar

            self._bar = progress_bar(total_steps, "train", "step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
            if self._sync is not None:
                self._sync(False)
        if self._logger is not None:
            self._logger.log_metrics(metrics, step=step)
        if self._bar is not None and "loss" in metrics:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics.get('lr', 0):.2e}", refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def _last_system_sample(self) -> None:
        """One more sample as the job ends: the monitor publishes only after a full interval, so a job
        shorter than one would have none (and the samples of a cut-short interval would be lost)."""
        try:
            self._system.collect_metrics()
            self._system.publish_metrics(self._system.aggregate_metrics())
            self._system.mlflow_logger.flush()
        except Exception as exc:  # noqa: BLE001 - system metrics must never fail a finished job
            print(f"trainer: last system metrics sample not logged: {exc}", file=sys.stderr)

    def log_params(self, params: dict) -> None:
        if self.enabled and self._logger is not None:
            self._logger.log_params(params)

    def log_checkpoints(self, committed: list[tuple[int, str]], stage: str) -> None:
        """Each committed checkpoint (step, URI in the store) as an MLflow LoggedModel with the metrics
        of its step linked (infra.tracking.RunLogger.log_checkpoint_model; a failure only warns). Called
        on the training thread after the step's metrics are logged, never from the checkpoint's own
        background thread: the metrics of the checkpoint's step are then in, and the logger is not
        shared between threads."""
        if self._logger is None:
            return
        for step, uri in committed:
            self._logger.log_checkpoint_model(step, uri, stage)

    def close(self) -> None:
        if self._system is not None:
            self._system.finish()
            self._last_system_sample()
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
            if self._sync is not None:
                self._sync(True)
        if self._logger is not None:
            self._logger.close()
