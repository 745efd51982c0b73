"""Which meshes the trainer composes is decided by config validation, before anything starts, and again
by the trainer at start (trainer.parallel.layouts.check_supported), from one list of rules
(infra.config.parallel.unsupported_layout). Every shipped config and preset still validates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.config import ConfigError, load_config
from infra.config.parallel import ParallelConfig
from trainer.parallel.layouts import check_supported

ROOT = Path(__file__).resolve().parents[2]
MOE = "model.moe={num_experts: 4, top_k: 1}"

REFUSED = [  # (overrides on configs/tiny.yaml, words the error must contain)
    (["parallel.nproc_per_node=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=2", MOE],
     ["parallel.zero=2", "ep=2", "FSDP"]),
    (["parallel.nproc_per_node=4", "parallel.dp=2", "parallel.cp=2", "parallel.zero=3"], ["parallel.zero=3", "cp=2"]),
    (["parallel.nproc_per_node=4", "parallel.tp=2", "parallel.dp=2"], ["parallel.tp=2", "dp=2", "zero=0", "DTensors"]),
    (["parallel.nproc_per_node=4", "parallel.tp=2", "parallel.cp=2"], ["parallel.tp=2", "cp=2", "zero=0"]),
    (["parallel.nproc_per_node=2", "parallel.pp=2", "parallel.pp_virtual_stages=2", "pretrain.micro_batch_size=2"],
     ["parallel.pp_schedule=1f1b", "pp_virtual_stages=2"]),
]
COMPOSED = [  # layouts these issues built: they validate
    ["parallel.nproc_per_node=8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1",
     "parallel.sequence_parallel=true", "pretrain.micro_batch_size=2"],  # the seed's mesh
    ["parallel.nproc_per_node=4", "parallel.tp=2", "parallel.cp=2", "parallel.zero=1"],
    ["parallel.nproc_per_node=4", "parallel.tp=2", "parallel.pp=2", "pretrain.micro_batch_size=2"],
    ["parallel.nproc_per_node=4", "parallel.dp=2", "parallel.ep=2", "parallel.cp=2", "parallel.zero=1", MOE],
    ["parallel.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2", "parallel.zero=1", "pretrain.micro_batch_size=4"],
    ["parallel.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "pretrain.micro_batch_size=4"],
    ["parallel.nproc_per_node=4", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1", MOE],
]


@pytest.mark.parametrize("overrides,words", REFUSED, ids=[f"refused{i}" for i in range(len(REFUSED))])
def test_unsupported_layout_is_a_config_error_and_a_start_error(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides)
    text = str(info.value)
    assert "parallel" in text and all(w in text for w in words), text
    # The trainer refuses the same layout at start when a config skipped validation (model_construct).
    raw = {k.split(".", 1)[1]: v for k, v in (o.split("=", 1) for o in overrides) if k.startswith("parallel.")}
    fields = {k: (v == "true") if v in ("true", "false") else int(v) for k, v in raw.items()}
    unchecked = ParallelConfig.model_construct(**{**ParallelConfig().model_dump(), **fields})
    with pytest.raises(NotImplementedError) as start:
        check_supported(unchecked)
    assert all(w in str(start.value) for w in words if w != "parallel"), str(start.value)


MODEL_REFUSED = [  # layouts this model cannot take: refused by validation and, unvalidated, at the trainer's start
    (["parallel.nproc_per_node=2", "parallel.pp=2", "pretrain.micro_batch_size=2", "model.tie_embeddings=true"],
     ["tie_embeddings", "pp=2"]),
    (["parallel.nproc_per_node=2", "parallel.tp=2", "model.tie_embeddings=true"], ["tie_embeddings", "tp=2"]),
    (["parallel.nproc_per_node=2", "parallel.pp=2", "pretrain.micro_batch_size=2", MOE], ["aux_loss", "balance=bias"]),
    # Seed: Ulysses's "degree is capped by the number of KV heads" (4 query heads split over cp=2, 1 KV head does not)
    (["parallel.nproc_per_node=2", "parallel.cp=2", "parallel.cp_impl=ulysses", "model.n_kv_heads=1"],
     ["parallel.cp_impl=ulysses", "parallel.cp=2", "model.n_kv_heads=1", "cp_impl=ring"]),
    # MTP reads later tokens' embeddings: not on a pipeline's last stage nor on a context-parallel shard (yet)
    (["parallel.nproc_per_node=2", "parallel.pp=2", "pretrain.micro_batch_size=2", "model.mtp_depth=1"],
     ["mtp_depth=1", "pp=2"]),
    (["parallel.nproc_per_node=2", "parallel.cp=2", "model.mtp_depth=2"], ["mtp_depth=2", "cp=2"]),
]


@pytest.mark.parametrize("overrides,words", MODEL_REFUSED, ids=[f"model{i}" for i in range(len(MODEL_REFUSED))])
def test_what_a_model_cannot_do_on_a_layout_is_refused_before_anything_starts(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides)
    assert all(w in str(info.value) for w in words), str(info.value)
    cfg = load_config("tiny", [o for o in overrides if o.startswith("model.")])  # the model alone is fine
    parallel = load_config("tiny", [o for o in overrides if not o.startswith("model.")]).parallel
    with pytest.raises(NotImplementedError) as start:
        check_supported(parallel, cfg.model)
    assert all(w in str(start.value) for w in words), str(start.value)


def test_ulysses_is_capped_by_the_kv_heads_per_tp_rank():
    """Refused, not served by duplicating KV heads: a copy per cp rank would multiply Ulysses's K/V
    all-to-all bytes by cp / KV heads, and ring attention takes any cp without copies."""
    ulysses = ["parallel.cp_impl=ulysses", "model.n_heads=8", "model.n_kv_heads=2", "model.dim=256"]
    load_config("tiny", ulysses + ["parallel.nproc_per_node=2", "parallel.cp=2"])  # cp = KV heads: composed
    load_config("tiny", ["model.n_heads=8", "model.dim=256", "parallel.nproc_per_node=4", "parallel.cp=4"])  # the ring
    # tp splits the KV heads first: 2 KV heads over tp=2 leave 1 per rank, which cp=2 cannot split.
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2 \(1 per tp rank\) is not divisible by cp=2"):
        load_config("tiny", ulysses + ["parallel.nproc_per_node=4", "parallel.cp=2", "parallel.tp=2",
                                       "parallel.zero=1"])


@pytest.mark.parametrize("overrides", COMPOSED, ids=[f"composed{i}" for i in range(len(COMPOSED))])
def test_composed_layouts_validate(overrides):
    cfg = load_config("tiny", overrides)
    check_supported(cfg.parallel)


SHIPPED = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "presets").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_shipped_configs_and_presets_validate(path):
    cfg = load_config(str(path))
    check_supported(cfg.parallel, cfg.model)  # what the trainer checks at start, the model's rules included


def test_seed_config_is_the_seed_mesh():
    p = load_config("seed-1b").parallel
    assert (p.dp, p.tp, p.pp, p.zero, p.pp_schedule, p.sequence_parallel) == (2, 2, 2, 1, "1f1b", True)


def test_config_show_refuses_an_unsupported_layout_before_anything_starts():
    sets = ["parallel.nproc_per_node=4", "parallel.tp=2", "parallel.dp=2"]  # tp x dp with DDP (zero=0)
    cmd = [sys.executable, "-m", "flows.cli", "config", "show", "tiny", *[x for s in sets for x in ("--set", s)]]
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "parallel.tp=2" in bad.stderr and "dp=2" in bad.stderr and "zero" in bad.stderr, bad.stderr
