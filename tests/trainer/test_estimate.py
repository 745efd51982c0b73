"""The estimator reproduces every number of the seed (issue 8, "Done when"), its formulas agree with
references computed another way (the real model's parameters and FLOP count, hand-written Korthikanti
and ring formulas, a played pipeline timeline), and the command writes JSON and pictures."""

from __future__ import annotations

import json

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
                          "model.moe.every=2", "model.moe.ffn_dim=96"])]
    for name, ov in variants:
        cfg = load_config(name, ov)
        ours, theirs = f.param_counts(cfg.model), model_mod.param_counts(cfg.model)
        assert (ours["total"], ours["active"], ours["embedding"]) == (theirs["total"], theirs["active"],
                                                                       theirs["embedding"]), (name, ov)
    moe = load_preset("seed-1b-moe")
    assert f.param_counts(moe.model)["total"] == model_mod.param_counts(moe.model)["total"]


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
    # ZeRO-1 over dp=2: 2 + 2 bytes kept, 12 sharded; the embedding and 3 layers split over tp=2.
    params0 = (32000 * 4096 + 3 * f.layer_params(4096, 32, 32, 128, 11008)["total"]) / tp
    assert first["bytes"]["weights"] + first["bytes"]["grads"] + first["bytes"]["optimizer"] == pytest.approx(
        params0 * (2 + 2 + 12 / 2))
    assert seed["busiest_pp_rank"] == 0 and seed["busiest_rank_bytes"] == pytest.approx(first["total_bytes"])
    assert (first["params"] + last["params"]) * tp == seed["params"]  # every parameter on exactly one stage


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


def test_collective_bytes():
    g = 1e9
    assert f.ring_allreduce_bytes(g, 4) == pytest.approx(2 * 3 / 4 * g)
    for zero in (1, 2):  # reduce-scatter + all-gather: "the traffic equals one all-reduce"
        assert f.data_parallel_bytes(g / 2, zero, 8) == pytest.approx(f.data_parallel_bytes(g / 2, 0, 8))
    assert f.data_parallel_bytes(g / 2, 3, 8) == pytest.approx(1.5 * f.data_parallel_bytes(g / 2, 0, 8))  # "1.5x"
    est = estimate_run(load_preset("seed-1b"))
    # TP: 4 all-reduces per layer per micro-batch, 3 layers on stage 0, 4 micro-batches, ring over t=2.
    assert est["comm_bytes_per_step"]["tp"] == pytest.approx(4 * 3 * 4 * 32 * MiB)
    # PP: 4 micro-batches cross the one boundary forward and back; sequence parallel halves the tensor.
    assert est["comm_bytes_per_step"]["pp"] == pytest.approx(4 * 16 * MiB)
    cp = estimate_run(load_preset("seed-1b", ["parallel.cp=2", "parallel.dp=1", "pretrain.global_batch_size=8"]))
    block = 2 * 2 * 1024 * (32 // 2) * 128 * 2  # K and V of 1,024 positions, 16 heads per tp rank
    assert cp["comm_bytes_per_step"]["cp"] == pytest.approx(3 * 1 * block * 3 * 4)
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


# ------------------------------------------------------------------------- the trainer's counted FLOPs


def test_tiny_estimate_matches_counted_flops():
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("trainer.model")
    from trainer.estimate import count_model_flops

    moe = ["model.moe.num_experts=4", "model.moe.top_k=2", "pretrain.micro_batch_size=2"]
    for ov in (["pretrain.micro_batch_size=4"], moe):
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
    cfg = load_config("tiny")
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
    for name in ("memory.png", "mesh.png", "pipeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_bad_input_is_named(capsys):
    assert estimate_command("seed-1b", "seed-1b", [], False, None) == 2
    assert estimate_command(None, "no-such-preset", [], False, None) == 2
    assert "known: " in capsys.readouterr().err
    assert estimate_command(None, "seed-1b", ["estimate.mfu=2"], False, None) == 2
