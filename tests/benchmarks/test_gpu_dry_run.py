"""benchmarks/gpu/run.sh --dry-run: the single-GPU check's every part, on CPU with tiny shapes (the
GPU-only kernels skipped and labelled), so the script a GPU will run has run here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_part(tmp_path, tiny_hf_model_dir):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(ROOT / "benchmarks" / "gpu" / "run.sh"), str(out), "--dry-run",
                           "--serve-model", str(tiny_hf_model_dir)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert proc.returncode == 0, (proc.stderr[-3000:], [r for r in rows if r.get("status") == "failed"])
    parts = {r["part"]: r for r in rows}
    header, end = rows[0], rows[-1]
    assert header["part"] == "header" and header["dry_run"] and len(header["needs_several_gpus"]) >= 3
    assert end == {**end, "part": "end", "failed_parts": []}
    assert set(header["parts"]) <= set(parts) and all(r["dry_run"] for r in rows)
    # the cuda tests are collected and skip here, saying why
    tests = parts["cuda_tests"]
    assert tests["skipped"] == len(tests["tests"]) >= 5 and tests["failed"] == 0 and "dry_run_note" in tests
    # the trainer itself: its steps, an async checkpoint and the final one
    job = parts["trainer_job"]
    assert job["job_status"] == "completed" and job["steps"] == 2 and job["checkpoint"].endswith("step_00000002")
    assert job["tokens_per_s"] > 0 and job["checkpoint_stall_s"] > 0
    # training: every variant ran its steps; fp8 went through torchao (emulated) and stayed near bf16
    for name in ("train_bf16", "train_bf16_compile", "train_fp8", "train_checkpointing"):
        assert parts[name]["tokens_per_s"] > 0 and parts[name]["estimate_memory_gb"] > 0
    assert parts["train_fp8"]["precision"] == "fp8" and parts["train_fp8"]["fp8_emulate"] is True
    assert parts["train_checkpointing"]["activation_checkpointing"] == "full"
    summary = parts["train_summary"]
    assert summary["loss_steps"] == len(parts["train_bf16_compile"]["losses"]) >= 3
    assert 0 < summary["loss_rel_diff_max"] < 0.02  # float8 rounds: near bf16, not equal
    # serving: each concurrency of the sweep against HF generate in static batches of its size
    sweep = [r for r in rows if r.get("figure") == "serve_concurrency"]
    assert [r["concurrency"] for r in sweep] == [1, 4]
    for r in sweep:
        assert r["failed"] == 0 and r["ttft_ms"]["median"] > 0 and r["tpot_ms"]["median"] > 0
        ratio = r["fresh_output_tokens_per_s"] / r["hf_static_output_tokens_per_s"]  # the fresh pass's requests
        assert r["ratio_vs_hf_static"] == pytest.approx(ratio)
    saves = [r for r in rows if r["part"] == "checkpoint"]
    assert saves[0]["figure"] == "checkpoint_save" and saves[0]["sync_save_s"] > 0 and saves[0]["async_stall_s"] > 0
