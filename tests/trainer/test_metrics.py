"""Model FLOPs against the seed's worked example, the matmul probe, the metrics sink, the mesh names."""

import json

import pytest
import torch

from infra.config import load_config
from infra.config.parallel import ParallelConfig
from trainer.metrics import MetricsSink, datasheet_peak_flops, flops_per_token, measure_peak_flops
from trainer.parallel.mesh import build_parallel_dims


def test_step_flops_match_the_seed():
    cfg = load_config("configs/seed-1b.yaml").model
    tokens = 16 * 2048  # the seed's global batch: 32,768 tokens
    total = flops_per_token(cfg, 2048) * tokens
    # Seed: 6 x 1.27B x 32,768 ~ 250 TFLOP, less ~26 for the embedding, plus ~16 of attention: ~240.
    assert total / 1e12 == pytest.approx(240, rel=0.02)
    attention = 12 * 5 * 2048 * 4096 * tokens
    assert attention / 1e12 == pytest.approx(16.5, rel=0.01)


def test_matmul_probe_is_a_plausible_rate():
    # The arithmetic, on a clock that advances 1 ms per reading: 4 matmuls of 2 * 256^3 FLOPs per 1 ms.
    ticks = iter(range(10**6))
    peak = measure_peak_flops(torch.device("cpu"), torch.float32, size=256, seconds=0.05,
                              clock=lambda: next(ticks) * 1e-3)
    assert peak == pytest.approx(4 * 2 * 256**3 / 1e-3)
    # The real clock, only as wide a plausibility range as a busy machine allows: on this 2-core box one
    # thread measured 1e11 FLOP/s, two threads fighting other work 6e8 (the former 1e8 floor was 6x away).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = measure_peak_flops(torch.device("cpu"), torch.float32, size=256, seconds=0.1)
    finally:
        torch.set_num_threads(threads)
    assert 1e7 < peak < 1e14


def test_datasheet_peak_matches_the_device_name_most_specific_first():
    # torch.cuda.get_device_name's spellings; NVIDIA's dense bf16 / fp8 tensor-core figures
    assert datasheet_peak_flops("NVIDIA H200") == 989e12 and datasheet_peak_flops("NVIDIA H200", fp8=True) == 1979e12
    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert datasheet_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert datasheet_peak_flops("NVIDIA A100-SXM4-80GB", fp8=True) is None  # no FP8 tensor cores
    assert datasheet_peak_flops("Tesla T4") is None  # unlisted: the trainer probes instead


def test_sink_writes_jsonl_on_rank0_only(tmp_path):
    sink = MetricsSink(tmp_path / "a", None, None, total_steps=2, enabled=True, progress=False)
    sink.log({"loss": 2.5, "lr": 1e-3}, step=1)
    sink.close()
    assert json.loads((tmp_path / "a" / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.5, "lr": 1e-3}
    quiet = MetricsSink(tmp_path / "b", None, None, total_steps=2, enabled=False)
    quiet.log({"loss": 1.0}, step=1)
    quiet.close()
    assert not (tmp_path / "b").exists()


def test_single_process_dims_keep_every_name_resolvable():
    dims = build_parallel_dims(ParallelConfig(), "cpu")
    assert dims.mesh is None and dims.world_size == 1
    for name in ("dp", "dp_replicate", "dp_shard", "pp", "cp", "tp", "ep"):
        assert dims.size(name) == 1 and dims.group(name) is None and dims.rank(name) == 0
    with pytest.raises(KeyError, match="unknown mesh dimension"):
        dims.size("sp")
    with pytest.raises(ValueError, match="world size|ranks"):
        build_parallel_dims(ParallelConfig(nproc_per_node=2, dp=2), "cpu")
