"""The estimator reproduces every number of the seed (issue 8, "Done when"), its formulas agree with
references computed another way (the real model's parameters and FLOP count, hand-written Korthikanti
and ring formulas, a played pipeline timeline), and the command writes JSON and pictures."""

from __future__ import annotations

import json
import math

import pytest

from infra.config import load_config
from trainer.estimate import JSON_KEYS, estimate_run
from trainer.estimate import formulas as f
from trainer.estimate.cli import estimate_command
from trainer.estimate.presets import load_preset, preset_names
from trainer.estimate.schedule import bubble_fraction, play

MiB, KiB = 2**20, 2**10


def close(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * abs(target)


@pytest.fixture(scope="module")
def seed():
    return estimate_run(load_preset("seed-1b"))


# ------------------------------------------------------------------------------------ the seed's numbers


def test_seed_parameters_and_state(seed):
    assert round(seed["params"] / 1e9, 2) == 1.27
    assert seed["state_bytes_per_param"] == 16
    assert round(seed["state_bytes"] / 1e9, 1) == 20.4  # "20.4 GB for our 1.27B model"
    fp32_accum = estimate_run(load_preset("seed-1b", ["pretrain.fp32_grad_accum=true"]))
    assert fp32_accum["state_bytes_per_param"] == 18  # "Megatron-style ... makes it 18 bytes"
    assert fp32_accum["state_bytes"] == seed["params"] * 18


def test_seed_flops_per_step(seed):
    tokens = seed["tokens_per_step"]
    assert tokens == 32_768
    assert close(6 * seed["params"] * tokens, 250e12, 0.01)  # "6 x 1.27B x 32,768 ~ 250 TFLOP"
    assert close(seed["embedding_flops_excluded_per_step"], 26e12, 0.02)  # "less about 26 TFLOP"
    assert close(seed["attention_flops_per_step"], 16e12, 0.04)  # "plus ~16 TFLOP of attention"
    assert close(seed["flops_per_step"], 240e12, 0.02)  # "roughly 240 TFLOP"
    assert seed["flops_per_step"] == pytest.approx(
        6 * seed["params"] * tokens - seed["embedding_flops_excluded_per_step"] + seed["attention_flops_per_step"])
    causal = estimate_run(load_preset("seed-1b", ["estimate.attention_flops=causal"]))
    assert causal["attention_flops_per_step"] == pytest.approx(seed["attention_flops_per_step"] / 2)


def test_seed_step_time_and_throughput(seed):
    # "989 dense bf16 TFLOP/s ... about 40% ... Eight GPUs ... about 0.08 s, around 430,000 tokens per second"
    assert seed["gpus"] == 8 and seed["mfu"] == 0.4 and seed["gpu_peak_flops"] == 989e12
    assert round(seed["step_time_s"], 2) == 0.08 and close(seed["step_time_s"], 0.08, 0.06)
    assert close(seed["tokens_per_s"], 430_000, 0.01)


def test_seed_tp_allreduce_and_kv_cache(seed):
    assert seed["tp_allreduce_bytes"] == 32 * MiB  # "[2, 2048, 4096] bf16 tensor of 32 MiB"
    assert seed["kv_bytes_per_token"] == 80 * KiB  # "2 x 5 x 32 x 128 x 2 = 80 KB"
    gqa = estimate_run(load_preset("seed-1b", ["model.n_kv_heads=8"]))
    assert gqa["kv_bytes_per_token"] == 20 * KiB  # "8 KV heads ... cuts it to 20 KB"


def test_seed_bubble(seed):
    assert seed["bubble_fraction"] == pytest.approx(0.2)  # "m = 4 and p = 2, so the bubble is 20%"
    assert seed["bubble_fraction_timeline"] == pytest.approx(0.2)


def test_seed_moe_total_and_active():
    moe = estimate_run(load_preset("seed-1b-moe"))
    assert close(moe["params"], 6.0e9, 0.01)  # "about 6.0B parameters"
    assert close(moe["active_params"], 1.95e9, 0.01)  # "the compute of about 1.95B per token"


def test_llama3_70b_state():
    est = estimate_run(load_preset("llama3-70b"))
    assert round(est["state_bytes"] / 1e12, 2) == 1.13  # "1.13 TB just for weights, gradients and optimizer"
    assert 14 < est["state_bytes"] / 80e9 < 15  # "more than fourteen GPUs' worth"


def test_llama3_405b_run():
    est = estimate_run(load_preset("llama3-405b"))
    run = est["run"]
    assert run["total_tokens"] == 15.6e12 and est["gpus"] == 16_384
    assert close(run["flops"], 3.8e25, 0.01)  # "6 x 405B x 15.6T ~ 3.8 x 10^25 FLOP"
    at_400 = estimate_run(load_preset("llama3-405b", ["estimate.gpu_peak_flops=1e15", "estimate.mfu=0.4"]))
    assert close(at_400["run"]["gpu_years"], 3000, 0.02)  # "One H100 at 400 TFLOP/s would need about 3,000 years"
    assert 45 < run["days"] < 90  # "16,384 H100s for a couple of months"
    # The seed's estimator: switch recompute off and the busiest GPU needs an order of magnitude more.
    no_recompute = estimate_run(load_preset("llama3-405b", ["estimate.activation_recompute=none"]))
    assert no_recompute["busiest_rank_breakdown"]["activations"] > 10 * est["busiest_rank_breakdown"]["activations"]


# ----------------------------------------------------------------- formulas against independent references


def test_param_counts_match_the_model():
    model_mod = pytest.importorskip("trainer.model")
    variants = [("tiny", []), ("seed-1b", []), ("tiny", ["model.tie_embeddings=true", "model.qk_norm=true"]),
                ("tiny", ["model.moe.num_experts=4", "model.moe.top_k=1", "model.moe.shared_expert=true",
                          "model.moe.every=2", "model.moe.ffn_dim=96"]),
                ("tiny", ["model.mtp_depth=2", "model.qk_norm=true"]),
                ("tiny", ["model.mtp_depth=1", "model.moe.num_experts=4", "model.moe.top_k=1", "model.moe.every=1"])]
    for name, ov in variants:
        cfg = load_config(name, ov)
        ours, theirs = f.param_counts(cfg.model), model_mod.param_counts(cfg.model)
        assert (ours["total"], ours["active"], ours["embedding"], ours["mtp"]) == (
            theirs["total"], theirs["active"], theirs["embedding"], theirs["mtp"]), (name, ov)
    assert f.param_counts(load_config("tiny", ["model.mtp_depth=2"]).model)["mtp"] > 0
    moe = load_preset("seed-1b-moe")
    assert f.param_counts(moe.model)["total"] == model_mod.param_counts(moe.model)["total"]


def test_mtp_modules_are_in_the_per_rank_state_and_activations():
    """model.mtp_depth: the modules' parameters (the real model's count, test above) sit with the head
    and hold one more block's activations (never recomputed) per depth, plus the 2h-wide projection input."""
    plain, mtp = load_config("tiny"), load_config("tiny", ["model.mtp_depth=2", "pretrain.activation_checkpointing=full"])
    a = estimate_run(plain)["stages"][0]
    b = estimate_run(mtp)["stages"][0]
    assert b["params"] - a["params"] == f.mtp_params(mtp.model)["total"] == 2 * (f.model_layer_params(mtp.model)[-1]["total"]
                                                                                  + 3 * 128 + 2 * 128 * 128)
    act = f.activation_bytes_per_layer(256, mtp.pretrain.micro_batch_size, 128, 4, act_bytes=4)  # fp32, not recomputed
    full = estimate_run(load_config("tiny", ["pretrain.activation_checkpointing=full"]))["stages"][0]
    extra = b["bytes"]["activations"] - full["bytes"]["activations"]
    assert extra == pytest.approx(2 * (act + 2 * 256 * mtp.pretrain.micro_batch_size * 128 * 4) * full["micro_batches_in_flight"])


def test_activation_formulas_korthikanti():
    s, b, h, a = 2048, 2, 4096, 32
    sbh = s * b * h
    assert f.activation_bytes_per_layer(s, b, h, a, flash_attention=False) == sbh * (34 + 5 * a * s / h)
    assert f.activation_bytes_per_layer(s, b, h, a, tp=2, flash_attention=False) == sbh * (10 + 24 / 2 + 5 * a * s / (h * 2))
    assert f.activation_bytes_per_layer(s, b, h, a, tp=2, sequence_parallel=True) == 34 * sbh / 2
    assert f.activation_bytes_per_layer(s, b, h, a, flash_attention=False, recompute="selective") == 34 * sbh
    assert f.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * sbh
    # "about 3 GB of activations per micro-batch" for the 5 layers on one GPU
    assert close(5 * f.activation_bytes_per_layer(s, b, h, a), 3e9, 0.06)
    with pytest.raises(ValueError, match="recompute"):
        f.activation_bytes_per_layer(s, b, h, a, recompute="some")


def test_busiest_rank_holds_p_micro_batches_and_logits(seed):
    s, b, h, V, tp, p = 2048, 2, 4096, 32000, 2, 2
    per_layer = 34 * s * b * h / tp
    first, last = seed["stages"]
    assert first["holds_embedding"] and first["layers"] == [0, 1, 2]
    assert last["holds_head"] and last["layers"] == [3, 4]
    assert first["bytes"]["activations"] == pytest.approx(p * 3 * per_layer)  # 1F1B: p in flight on stage 0
    assert last["bytes"]["activations"] == pytest.approx(1 * 2 * per_layer)
    assert last["bytes"]["logits"] == 4 * s * b * V / tp and first["bytes"]["logits"] == 0
    # ZeRO-1 over dp=2: 2 + 2 bytes kept, 12 sharded; the embedding and 3 layers split over tp=2 but for
    # their norm gains, whole on every tp rank (trainer/parallel/tensor_parallel.py).
    layer = f.layer_params(4096, 32, 32, 128, 11008)
    assert layer["tp_whole"] == 2 * 4096
    params0 = (32000 * 4096 + 3 * (layer["total"] - layer["tp_whole"])) / tp + 3 * layer["tp_whole"]
    assert first["bytes"]["weights"] + first["bytes"]["grads"] + first["bytes"]["optimizer"] == pytest.approx(
        params0 * (2 + 2 + 12 / 2))
    assert seed["busiest_pp_rank"] == 0 and seed["busiest_rank_bytes"] == pytest.approx(first["total_bytes"])
    gains = 5 * 2 * 4096 + 4096  # every layer's two norms and the final norm, replicated over tp
    assert (first["params"] + last["params"] - gains) * tp + gains == seed["params"]  # each on one stage


def test_zero_stages_per_rank():
    cfg = load_preset("seed-1b", ["parallel.dp=8", "parallel.tp=1", "parallel.pp=1", "parallel.pp_split=auto",
                                  "parallel.sequence_parallel=false"])
    est = estimate_run(cfg)
    n = est["params"]
    by_zero = est["state_bytes_per_rank_by_zero"]
    assert by_zero["0"] == pytest.approx(16 * n)
    assert by_zero["1"] == pytest.approx((2 + 2 + 12 / 8) * n)
    assert by_zero["2"] == pytest.approx((2 + 14 / 8) * n)
    assert by_zero["3"] == pytest.approx(16 * n / 8)


def test_fsdp_keeps_fp32_shards_as_masters():
    """ZeRO-3 is FSDP2: fp32 parameter and gradient shards plus the moments, 16/d bytes per parameter with or
    without fp32 gradient reduction (not the seed's 18: the bf16 weight exists only while gathered); on the
    wire the weights go in bf16 and the gradients in bf16, or fp32 with fp32_grad_accum."""
    base = ["parallel.dp=8", "parallel.tp=1", "parallel.pp=1", "parallel.pp_split=auto",
            "parallel.sequence_parallel=false", "parallel.zero=3"]
    plain = estimate_run(load_preset("seed-1b", base))
    acc = estimate_run(load_preset("seed-1b", base + ["pretrain.fp32_grad_accum=true"]))
    n = plain["params"]
    for est in (plain, acc):
        assert est["state_bytes_per_rank"] == pytest.approx(16 * n / 8)
        assert est["state_bytes_per_param_breakdown"] == {"weights": 4, "grads": 4, "optimizer": 8}
    gather, reduce = 2 * 7 / 8 * n * 2, 7 / 8 * n  # per micro-batch: a forward and a backward gather of bf16
    m = plain["micro_batches"]
    assert plain["comm_bytes_per_step"]["dp"] == pytest.approx(m * gather + 2 * reduce)
    assert acc["comm_bytes_per_step"]["dp"] == pytest.approx(m * gather + 4 * reduce)


def test_collective_bytes():
    g = 1e9
    assert f.ring_allreduce_bytes(g, 4) == pytest.approx(2 * 3 / 4 * g)
    for zero in (1, 2):  # reduce-scatter + all-gather: "the traffic equals one all-reduce"
        assert f.data_parallel_bytes(g / 2, zero, 8) == pytest.approx(f.data_parallel_bytes(g / 2, 0, 8))
    assert f.data_parallel_bytes(g / 2, 3, 8) == pytest.approx(1.5 * f.data_parallel_bytes(g / 2, 0, 8))  # "1.5x"
    # FSDP reduce-scatters every micro-batch's gradients (ZeRO-2 keeps them sharded): m reductions per step.
    ddp = f.data_parallel_bytes(g / 2, 0, 8)
    assert f.data_parallel_bytes(g / 2, 2, 8, micro_batches=4, reductions=4) == pytest.approx(2.5 * ddp)
    assert f.data_parallel_bytes(g / 2, 3, 8, micro_batches=4, reductions=4) == pytest.approx(6 * ddp)
    hsdp1 = f.data_parallel_bytes(g / 2, 2, 4, replicate=2) - f.data_parallel_bytes(g / 2, 2, 4)
    hsdp4 = (f.data_parallel_bytes(g / 2, 2, 4, replicate=2, reductions=4)
             - f.data_parallel_bytes(g / 2, 2, 4, reductions=4))
    assert hsdp1 > 0 and hsdp4 == pytest.approx(4 * hsdp1)
    est = estimate_run(load_preset("seed-1b"))
    # TP: 4 all-reduces per layer per micro-batch, 3 layers on stage 0, and the vocab-parallel embedding's
    # all-reduce; 4 micro-batches, ring over t=2 (2(t-1)/t = 1); the 2 x 3 norm gains' partial bf16 gradients
    # once (sequence parallel is on).
    assert est["comm_bytes_per_step"]["tp"] == pytest.approx((4 * 3 + 1) * 4 * 32 * MiB + 2 * 3 * 4096 * 2)
    stage1 = est["stages"][1]["comm_bytes"]["tp"]  # 2 layers, the head's input gradient, the cross-entropy's 3
    assert stage1 == pytest.approx((4 * 2 + 1) * 4 * 32 * MiB + 4 * 3 * 2 * 2048 * 4 + (2 * 2 + 1) * 4096 * 2)
    # PP: 4 micro-batches cross the one boundary forward and back; sequence parallel halves the tensor.
    assert est["comm_bytes_per_step"]["pp"] == pytest.approx(4 * 16 * MiB)
    cp = estimate_run(load_preset("seed-1b", ["parallel.cp=2", "parallel.dp=1", "pretrain.global_batch_size=8"]))
    block = 2 * 2 * 1024 * (32 // 2) * 128 * 2  # K and V of 1,024 positions, 16 heads per tp rank, bf16
    # 1 hop of K/V forward and 1 backward, 2 hops of their fp32 gradients (2x the bytes); 3 layers, 4 micro-batches
    assert cp["comm_bytes_per_step"]["cp"] == pytest.approx((2 * 1 * block + 2 * 2 * block) * 3 * 4)
    moe = estimate_run(load_preset("seed-1b-moe"))
    assert moe["comm_bytes_per_step"]["ep"] == pytest.approx(4 * (2 * 2048 * 2 * 4096 * 2) / 2 * 3 * 4)


def test_layer_split_puts_fewer_layers_with_the_head():
    auto = load_preset("seed-1b", ["parallel.pp_split=auto"])
    assert [len(st["layers"]) for st in estimate_run(auto)["stages"]] == [3, 2]
    assert f.split_layers([1.0] * 8, 4) == [2, 2, 2, 2]
    with pytest.raises(ValueError):
        f.split_layers([1.0] * 2, 3)


# ------------------------------------------------------------------------------------- pipeline schedules


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 2), (8, 16, 4), (4, 4, 2)])
def test_timelines_reproduce_the_bubble_formula(p, m, v):
    for schedule, vv in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", v)):
        tl = play(schedule, p, m, vv)
        assert tl.bubble_fraction == pytest.approx(bubble_fraction(p, m, vv)), schedule
        assert sum(x.end - x.start for x in tl.passes) == pytest.approx(3 * m * p)  # every pass ran once
    assert [play("gpipe", p, m).peak_in_flight(r) for r in range(p)] == [m] * p
    assert [play("1f1b", p, m).peak_in_flight(r) for r in range(p)] == [p - r for r in range(p)]
    # Korthikanti: the first rank of an interleaved schedule holds p*v + p - 1 chunks (when m allows).
    assert play("interleaved_1f1b", p, m, v).peak_in_flight(0) == min(p * v + p - 1, m * v)
    assert bubble_fraction(p, m, v) < bubble_fraction(p, m)  # interleaving shrinks the bubble


def test_interleaved_needs_m_divisible_by_p():
    with pytest.raises(ValueError, match="divisible"):
        play("interleaved_1f1b", 4, 6, 2)
    # The estimate falls back to the formulas and says so.
    est = estimate_run(load_preset("seed-1b", ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
                                               "parallel.pp_split=auto", "pretrain.global_batch_size=12"]))
    assert est["bubble_fraction"] == pytest.approx(1 / 7) and est["bubble_fraction_timeline"] is None
    assert "m % p" in est["pipeline_note"]


def test_layout_changes_move_the_estimate(seed):
    gpipe = estimate_run(load_preset("seed-1b", ["parallel.pp_schedule=gpipe"]))
    # GPipe holds all m = 4 micro-batches on the first stage, 1F1B only p = 2.
    assert gpipe["stages"][0]["bytes"]["activations"] == pytest.approx(2 * seed["stages"][0]["bytes"]["activations"])
    doubled = estimate_run(load_preset("seed-1b", ["estimate.gpus=16"]))
    assert doubled["step_time_s"] == pytest.approx(seed["step_time_s"] / 2)
    from trainer.estimate import tracking_params

    logged = tracking_params(seed)
    assert logged["estimate.flops_per_step"] == seed["flops_per_step"] and len(logged) >= 8


# ----------------------------------------------------------------------------------------------- serving

H100_BW = 3.35e12
# The seed's 1.27B toy served on one GPU: 5 layers of 4*4096^2 (q, k, v, o) + 3*4096*11008 (SwiGLU) + 2*4096
# (norms) = 1,011,916,800 parameters, plus the 32,000 x 4,096 embedding and head and the final norm.
SEED_LAYERS = 5 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)
SEED_PARAMS = SEED_LAYERS + 2 * 32000 * 4096 + 4096  # 1,274,064,896
# Read by one decode step: the layers, the head's V x h matmul, the final norm, one embedding row (bf16).
SEED_DECODE_READ = 2 * (SEED_LAYERS + 32000 * 4096 + 4096 + 4096)  # 2,285,993,984 bytes
ONE_GPU = ["estimate.serve.tp=1"]  # prompt 512 + output 256 tokens (the defaults)


@pytest.fixture(scope="module")
def served():
    return estimate_run(load_preset("seed-1b", ONE_GPU))["serve"]


def test_decode_at_one_sequence_reads_the_weights(served):
    assert SEED_PARAMS == 1_274_064_896 and served["weight_bytes"] == 2 * SEED_PARAMS
    one = served["table"][0]
    assert one["concurrency"] == 1 and one["bound"] == "weights"  # bandwidth-bound, weights dominate
    assert one["weight_bytes"] == SEED_DECODE_READ
    # 2.29 GB / 3.35 TB/s = 0.682 ms; one sequence's KV (640 tokens x 80 KiB = 52 MB) adds 2.3%.
    assert SEED_DECODE_READ / H100_BW <= one["tpot_s"] <= 1.03 * SEED_DECODE_READ / H100_BW
    assert one["tpot_s"] == pytest.approx((SEED_DECODE_READ + 640 * 80 * KiB) / H100_BW)
    assert one["compute_s"] < one["memory_s"] / 100  # "only a couple of FLOPs per byte"


def test_throughput_climbs_linearly_then_stops_at_the_kv_limit(served):
    rows = served["table"]
    assert [r["concurrency"] for r in rows[:4]] == [1, 2, 4, 8]
    assert rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"] > 1.9  # "climbs almost linearly"
    assert rows[1]["tpot_s"] / rows[0]["tpot_s"] < 1.05  # "costs little more per step than serving 1"
    tps = [r["tokens_per_s"] for r in rows]
    assert tps == sorted(tps)
    # By hand: 80 GB x 0.9 - 2.548 GB of bf16 weights = 69.45 GB for the cache; a sequence at its final
    # 768 tokens holds 768 x 81,920 bytes = 62.9 MB: 1,103.9 -> 1,103 sequences, the table's last row.
    assert served["kv_capacity_tokens"] == pytest.approx((80e9 * 0.9 - 2 * SEED_PARAMS) / (80 * KiB))
    assert served["max_concurrency"] == 1103 == rows[-1]["concurrency"]
    assert rows[-1]["kv_bytes"] == pytest.approx(1103 * 640 * 80 * KiB)
    # The curve bends where the batch's KV reads reach the weight reads: 2.29 GB / 52.4 MB = 43.6 -> 44.
    assert served["knee_concurrency"] == math.ceil(SEED_DECODE_READ / (640 * 80 * KiB)) == 44
    assert served["knee_reason"] == "kv_reads" and served["knees"]["compute"] is None  # MHA: ~1 FLOP/KV byte


def test_fp8_kv_doubles_capacity_and_gqa_is_20kb(served):
    fp8 = estimate_run(load_preset("seed-1b", ONE_GPU + ["estimate.serve.kv_dtype=fp8"]))["serve"]
    assert fp8["kv_bytes_per_token"] == 40 * KiB
    assert fp8["kv_capacity_tokens"] == pytest.approx(2 * served["kv_capacity_tokens"])
    assert fp8["max_concurrency"] in (2 * 1103, 2 * 1103 + 1) and fp8["max_concurrency"] == 2207
    gqa = estimate_run(load_preset("seed-1b", ONE_GPU + ["model.n_kv_heads=8"]))["serve"]
    assert gqa["kv_bytes_per_token"] == 20 * KiB  # "8 KV heads ... cuts it to 20 KB"
    assert gqa["max_concurrency"] > 3.9 * served["max_concurrency"]
    int4 = estimate_run(load_preset("seed-1b", ONE_GPU + ["estimate.serve.weight_dtype=int4"]))["serve"]
    assert int4["weight_bytes"] == SEED_LAYERS / 2 + 2 * (SEED_PARAMS - SEED_LAYERS)  # head/embedding stay bf16
    assert int4["tpot_s"] < 0.45 * served["tpot_s"]


def test_ttft_is_prefill_compute():
    est = estimate_run(load_preset("seed-1b", ONE_GPU))
    sv = est["serve"]
    # 512 tokens x (2 x 1.143B matmul weights + 4 x 5 layers x 512 keys x 4,096) at 989 TFLOP/s x 40%.
    flops = 512 * (2 * (SEED_PARAMS - 32000 * 4096) + 4 * 5 * 512 * 4096)
    assert sv["prefill"]["flops"] == pytest.approx(flops)
    assert sv["prefill"]["bound"] == "compute" and sv["ttft_s"] == pytest.approx(flops / (989e12 * 0.4))
    # Tensor parallelism splits it (plus 10 all-reduces of 512 x 4,096 bf16 at 450 GB/s and 10 us each).
    tp2 = estimate_run(load_preset("seed-1b"))["serve"]
    assert tp2["tp"] == 2
    assert tp2["ttft_s"] == pytest.approx(flops / 2 / (989e12 * 0.4) + 10 * (512 * 4096 * 2 / 450e9 + 1e-5))


def test_moe_decode_reads_only_active_experts():
    cfg = load_preset("seed-1b-moe", ONE_GPU)
    counts = f.param_counts(cfg.model)
    sv = estimate_run(cfg)["serve"]
    # One token visits top-2 of 8 experts: the step reads the active parameters (less the embedding table,
    # plus the one row looked up), not all 6.0B.
    assert sv["weight_read_bytes_per_step"] == 2 * (counts["active"] - counts["embedding"]) + 2 * 4096
    assert sv["weight_read_bytes_per_step"] < 0.35 * sv["weight_bytes"]
    assert sv["weight_bytes"] == 2 * counts["total"]
    # A batch visits more experts: E(1 - (1 - k/E)^n), all 8 at 64 tokens.
    assert f.experts_touched(8, 2, 1) == 2 and f.experts_touched(8, 2, 64) == pytest.approx(8, rel=1e-6)
    rows = {r["concurrency"]: r for r in sv["table"]}
    assert rows[64]["weight_bytes"] == pytest.approx(2 * (counts["total"] - counts["embedding"]), rel=1e-3)


def test_large_batches_turn_compute_bound():
    sv = estimate_run(load_preset("llama3-70b"))["serve"]  # GQA 8: the KV cache is cheap to read
    knee = sv["knees"]["compute"]
    assert sv["knee_reason"] == "compute" and knee == sv["knee_concurrency"] < sv["max_concurrency"]
    for r in sv["table"]:
        assert (r["bound"] == "compute") == (r["concurrency"] >= knee), r["concurrency"]
    no_fit = estimate_run(load_preset("llama3-405b"))["serve"]  # 810 GB of bf16 weights on 8 x 80 GB
    assert no_fit["max_concurrency"] == 0 and no_fit["table"] == [] and "quantize" in no_fit["notes"][0]


# ------------------------------------------------------------------------- links, placement and the m >= 4p rule


def test_link_time_and_placement():
    from trainer.estimate.links import mesh_groups

    seed = estimate_run(load_preset("seed-1b"))
    assert all(link["link"] == "nvlink" for link in seed["comm_links"].values())  # one node of 8
    for dim in ("dp", "tp", "pp"):
        assert seed["comm_time_s_per_step"][dim] == pytest.approx(seed["comm_bytes_per_step"][dim] / 450e9)
    assert not [w for w in seed["warnings"] if "crosses nodes" in w]
    # The trainer's rank order: tp innermost, then pp, dp outermost; ep cuts each dp x cp group.
    groups = {k: v.tolist() for k, v in mesh_groups(load_preset("seed-1b-moe").parallel).items()}
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == groups["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Two nodes of 4: tp and pp stay inside a node, the dp pairs (rank r and r + 4) cross the network.
    two = estimate_run(load_preset("seed-1b", ["parallel.nnodes=2", "parallel.nproc_per_node=4"]))
    assert two["comm_links"]["dp_cp"]["link"] == "network" and two["comm_links"]["tp"]["link"] == "nvlink"
    assert two["comm_time_s_per_step"]["dp"] == pytest.approx(two["comm_bytes_per_step"]["dp"] / 50e9)
    assert two["comm_time_s_per_step"]["tp"] == pytest.approx(seed["comm_time_s_per_step"]["tp"])
    assert not [w for w in two["warnings"] if "crosses nodes" in w]
    # HSDP (seed: "shards inside a node and replicates across nodes"): only the replica all-reduce crosses.
    hsdp = estimate_run(load_preset("seed-1b", ["parallel.nnodes=2", "parallel.dp=4", "parallel.zero=3",
                                                "parallel.dp_replicate=2"]))
    assert (hsdp["comm_links"]["dp_shard"]["link"], hsdp["comm_links"]["dp_replicate"]["link"]) == ("nvlink", "network")
    dp_bytes = hsdp["comm_bytes_per_step"]["dp"]
    assert dp_bytes / 450e9 < hsdp["comm_time_s_per_step"]["dp"] < dp_bytes / 50e9
    # One GPU per node: tensor parallelism crosses nodes, 9x slower, and the estimate says so.
    spread = estimate_run(load_preset("seed-1b", ["parallel.nnodes=8", "parallel.nproc_per_node=1"]))
    assert spread["comm_time_s_per_step"]["tp"] == pytest.approx(9 * seed["comm_time_s_per_step"]["tp"])
    assert any("tensor parallelism crosses nodes" in w for w in spread["warnings"])
    cp = estimate_run(load_preset("seed-1b", ["parallel.nnodes=2", "parallel.nproc_per_node=4", "parallel.dp=1",
                                              "parallel.pp=2", "parallel.cp=2", "pretrain.global_batch_size=8"]))
    assert cp["comm_links"]["cp"]["link"] == "nvlink"  # tp x cp = 4 fills a node of 4
    assert not [w for w in cp["warnings"] if "crosses nodes" in w]
    cp8 = estimate_run(load_preset("seed-1b", ["parallel.nnodes=2", "parallel.nproc_per_node=4", "parallel.dp=1",
                                               "parallel.pp=1", "parallel.pp_split=auto", "parallel.tp=4", "parallel.cp=2",
                                               "pretrain.global_batch_size=2", "pretrain.micro_batch_size=2"]))
    assert any("context parallelism crosses nodes: tp x cp = 4 x 2 = 8 > nproc_per_node=4" in w
               for w in cp8["warnings"])


def test_one_f_one_b_rule_of_thumb(seed):
    rule = [w for w in seed["warnings"] if "4p" in w]
    assert len(rule) == 1 and "m=4" in rule[0] and "p=2" in rule[0] and "seed's own example" in rule[0]
    enough = estimate_run(load_preset("seed-1b", ["pretrain.global_batch_size=32"]))  # m = 8 = 4p
    assert enough["micro_batches"] == 8 and not [w for w in enough["warnings"] if "4p" in w]
    gpipe = estimate_run(load_preset("seed-1b", ["parallel.pp_schedule=gpipe"]))  # the rule is for plain 1F1B
    assert not [w for w in gpipe["warnings"] if "4p" in w]


# ------------------------------------------------------------------------- the trainer's counted FLOPs


def test_tiny_estimate_matches_counted_flops():
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("trainer.model")
    from trainer.estimate import count_model_flops

    moe = ["model.moe.num_experts=4", "model.moe.top_k=2", "pretrain.micro_batch_size=2"]
    mtp = ["model.mtp_depth=2", "pretrain.micro_batch_size=2"]
    for ov in (["pretrain.micro_batch_size=4"], moe, mtp):
        cfg = load_config("tiny", ov)
        torch.manual_seed(0)
        model = model_mod.Transformer(cfg.model)
        b, s = cfg.pretrain.micro_batch_size, cfg.pretrain.seq_len
        rows = torch.randint(0, cfg.model.vocab_size, (b, s + 1))
        counted = count_model_flops(model, (rows[:, :-1], rows[:, 1:]))
        est = estimate_run(cfg)
        estimated = est["flops_per_step"] / (est["micro_batches"] * cfg.parallel.dp)  # one micro-batch
        assert abs(estimated / counted - 1) < 0.05, (ov, estimated, counted)
        assert all(p.grad is None for p in model.parameters())  # gradients are put back as they were
    try:
        from trainer.metrics import flops_per_token
    except ImportError:
        return
    for ov in ([], mtp):
        cfg = load_config("tiny", ov)
        assert flops_per_token(cfg.model, cfg.pretrain.seq_len) == pytest.approx(estimate_run(cfg)["flops_per_token"])


# --------------------------------------------------------------------------------------------- command


def test_json_keys_are_stable(capsys):
    assert estimate_command(None, "seed-1b", [], True, None) == 0
    out = json.loads(capsys.readouterr().out)
    for key in JSON_KEYS:
        assert key in out, key
    assert out["params"] == estimate_run(load_preset("seed-1b"))["params"]
    assert set(preset_names()) >= {"seed-1b", "seed-1b-moe", "llama3-70b", "llama3-405b"}
    for name in preset_names():
        est = estimate_run(load_preset(name))
        assert all(est[k] is not None for k in JSON_KEYS), name


def test_summary_and_plots(tmp_path, capsys):
    assert estimate_command("seed-1b", None, ["pretrain.global_batch_size=32"], False, str(tmp_path)) == 0
    text = capsys.readouterr().out
    assert "1.27B" in text and "20.39 GB" in text and "32.0 MiB" in text
    assert "Serving on 2 GPUs" in text and "ms on NVLink" in text and "Decode by concurrency" not in text
    assert estimate_command("seed-1b", None, ONE_GPU, False, None, serve=True) == 0
    view = capsys.readouterr().out
    assert "Decode by concurrency" in view and "1,103 sequences" in view and "20.39 GB" not in view
    for name in ("memory.png", "mesh.png", "pipeline.png", "serving.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_bad_input_is_named(capsys):
    assert estimate_command("seed-1b", "seed-1b", [], False, None) == 2
    assert estimate_command(None, "no-such-preset", [], False, None) == 2
    assert "known: " in capsys.readouterr().err
    assert estimate_command(None, "seed-1b", ["estimate.mfu=2"], False, None) == 2


def test_fp8_estimate_holds_what_the_trainer_holds_under_bf16():
    """precision fp8 keeps bf16 weights, fp32 masters and bf16 activations (torchao's Float8Linear casts per
    matmul and saves its bf16 inputs: trainer/precision.py), so its memory, bytes on the wire and model
    FLOPs are bf16's, not fp32's."""
    layout = ["parallel.tp=1", "parallel.dp=4", "parallel.sequence_parallel=false"]
    fp8, bf16, fp32 = (estimate_run(load_preset("seed-1b", [*layout, f"pretrain.precision={p}"]))
                       for p in ("fp8", "bf16", "fp32"))
    for key in ("busiest_rank_bytes", "state_bytes_per_rank", "flops_per_step", "comm_bytes_per_step",
                "activation_bytes_per_layer"):
        assert fp8[key] == bf16[key], key
    assert fp8["activation_bytes_per_layer"] < fp32["activation_bytes_per_layer"]
    assert f.state_bytes_per_param("fp8") == f.state_bytes_per_param("bf16") == {"weights": 2, "grads": 2,
                                                                                  "optimizer": 12}
