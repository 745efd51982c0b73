"""Config validation: every bad config fails before anything starts, naming the field, value and rule."""

import subprocess
import sys

import pytest

from infra.config import ConfigError, LifecycleConfig, apply_overrides, load_config, load_raw, validate_config

BAD = [
    # (overrides, field path expected in the message, words expected in the message)
    (["model.n_layers=0"], "model.n_layers", "greater than or equal to 1"),
    (["model.dim=abc"], "model.dim", "valid integer"),
    (["model.n_heads=3"], "model", "not divisible by n_heads=3"),
    (["model.n_kv_heads=3"], "model", "n_kv_heads=3"),
    (["pretrain.precision=fp16"], "pretrain.precision", "'fp32', 'bf16' or 'fp8'"),
    (["pretrain.precision=fp8", "pretrain.fp8.recipe=blockwise"], "pretrain.fp8.recipe", "'tensorwise' or 'rowwise'"),
    (["pretrain.bogus=1"], "pretrain.bogus", "unknown field"),
    (["parallel.tp=2"], "parallel", "must equal the world size"),
    (["parallel.nproc_per_node=4", "parallel.tp=4", "model.n_heads=6", "model.n_kv_heads=6", "model.head_dim=32"],
     "model.n_heads=6", "parallel.tp=4"),
    (["pretrain.global_batch_size=15"], "global_batch_size=15", "micro_batch_size*dp"),
    (["pretrain.seq_len=1024"], "pretrain.seq_len=1024", "max_seq_len=256"),
    (["tokenizer.vocab_size=5000"], "tokenizer.vocab_size=5000", "model.vocab_size=4096"),
    (["pretrain.warmup_steps=500"], "pretrain", "warmup_steps=500 exceeds steps=200"),
    (["pretrain.lr=-1"], "pretrain.lr", "greater than 0"),
    (["parallel.nproc_per_node=2", "parallel.pp=2", "pretrain.global_batch_size=8"], "pipeline", "micro-batches"),
    (["parallel.ep=2", "parallel.nproc_per_node=2", "parallel.dp=2"], "parallel.ep=2", "model.moe"),
    (["model.moe={num_experts: 2, top_k: 3}"], "model.moe", "top_k=3 exceeds num_experts=2"),
    (["infra.store=ftp://x"], "infra.store", "file:// or s3://"),
    (["parallel.dp_replicate=2", "parallel.dp=2", "parallel.nproc_per_node=2"], "parallel", "HSDP"),
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp=2", "parallel.nproc_per_node=2"], "parallel", "pp_virtual_stages"),
]


@pytest.mark.parametrize("overrides,field,words", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_names_field_value_and_rule(overrides, field, words):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides)
    text = str(info.value)
    assert field in text, text
    assert words in text, text


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["model.dim=abc", "pretrain.precision=fp16", "pretrain.bogus=1"])
    assert len(info.value.problems) == 3


def test_set_overrides_coerce_types_and_nest():
    cfg = load_config("tiny", ["pretrain.lr=1e-3", "model.qk_norm=true", "parallel.pp=2", "parallel.nproc_per_node=2", "parallel.pp_split=[3,1]",
                               "model.moe={num_experts: 4, top_k: 1, balance: bias}", "name=abc"])
    assert cfg.pretrain.lr == pytest.approx(1e-3) and cfg.model.qk_norm is True
    assert cfg.parallel.pp_split == [3, 1]
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.top_k == 1 and cfg.model.moe.balance == "bias"
    assert cfg.name == "abc"


def test_override_syntax_errors():
    raw, _ = load_raw("tiny")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides(raw, ["pretrain.lr"])
    with pytest.raises(ConfigError, match="is not a section"):
        apply_overrides(raw, ["name.x=1"])


def test_shipped_configs_validate():
    tiny = load_config("tiny")
    seed = load_config("seed-1b")
    assert isinstance(tiny, LifecycleConfig)
    assert (seed.parallel.dp, seed.parallel.tp, seed.parallel.pp) == (2, 2, 2)
    assert seed.parallel.world_size == 8 and seed.grad_accum_steps == 4
    assert (seed.model.dim, seed.model.n_layers, seed.model.ffn_dim, seed.model.vocab_size) == (4096, 5, 11008, 32000)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="YAML mapping"):
        validate_config([1, 2])  # type: ignore[arg-type]


def test_cli_config_show_exits_nonzero_before_anything_starts():
    ok = subprocess.run([sys.executable, "-m", "flows.cli", "config", "show", "tiny", "--set", "pretrain.lr=1e-3"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "lr: 0.001" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "flows.cli", "config", "show", "tiny", "--set", "model.dim=abc"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "model.dim" in bad.stderr and "'abc'" in bad.stderr
