"""Pure-python checks of the parallel-II helpers: the pipeline split, chunk placement, the bubble
closed form, zigzag layout and its tile balance, and the config refusals."""

import pytest
import torch

from infra.config import LifecycleConfig
from infra.config.model import ModelConfig
from infra.config.parallel import ParallelConfig
from trainer.parallel.context_parallel import tile_counts, zigzag_positions, zigzag_shard, zigzag_unshard
from trainer.parallel.pipeline_formulas import bubble_formula
from trainer.parallel.pipeline_split import chunk_layer_counts, chunks_of_rank


def test_zigzag_balances_causal_tiles_and_naive_does_not():
    for cp in (2, 4, 8):
        zig, naive = tile_counts(cp, "zigzag"), tile_counts(cp, "naive")
        assert sum(zig) == sum(naive) == (2 * cp) * (2 * cp + 1) // 2  # the causal lower triangle of tiles
        assert max(zig) <= 1.10 * min(zig)  # within 10% (in fact equal: 2c + 1 each)
        assert max(naive) / min(naive) > 1.5 * cp / 2  # the last rank does far more than the first
    assert tile_counts(4, "naive") == [3, 7, 11, 15] and tile_counts(4, "zigzag") == [9, 9, 9, 9]


def test_zigzag_split_round_trips_and_positions_follow():
    x = torch.arange(2 * 16).view(2, 16)
    shards = [zigzag_shard(x, 4, r) for r in range(4)]
    assert shards[0][0].tolist() == [0, 1, 14, 15] and shards[3][0].tolist() == [6, 7, 8, 9]
    assert torch.equal(zigzag_unshard(shards), x)
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        zigzag_positions(12, 4, 0)


def test_auto_split_gives_the_head_stage_fewer_layers():
    seed = ModelConfig(vocab_size=32000, dim=4096, n_layers=5, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                       max_seq_len=2048)
    par = ParallelConfig(nproc_per_node=2, pp=2)
    assert chunk_layer_counts(seed, par, seq_len=2048) == [3, 2]  # the seed's 3 + 2: the head costs 0.6 layer
    par = ParallelConfig(nproc_per_node=2, pp=2, pp_split=[4, 1])
    assert chunk_layer_counts(seed, par, 2048) == [4, 1]
    with pytest.raises(ValueError, match="pp_split"):
        chunk_layer_counts(seed, ParallelConfig(nproc_per_node=2, pp=2, pp_split=[5, 0]), 2048)


def test_chunk_placement_loop_and_v():
    assert [chunks_of_rank(r, 4, 2, "interleaved_1f1b") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [chunks_of_rank(r, 2, 2, "zbv") for r in range(2)] == [[0, 3], [1, 2]]
    assert bubble_formula(2, 4) == pytest.approx(1 / 5) and bubble_formula(4, 8, 2) == pytest.approx(3 / 19)


def tiny(**parallel):
    return {"model": {"vocab_size": 320, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                      "max_seq_len": 32},
            "tokenizer": {"vocab_size": 320}, "parallel": parallel,
            "pretrain": {"seq_len": 32, "micro_batch_size": 2, "global_batch_size": 8}}


def test_config_refusals_name_the_problem():
    with pytest.raises(ValueError, match="at least pp=4 micro-batches"):
        LifecycleConfig.model_validate({**tiny(nproc_per_node=4, pp=4), "pretrain": {
            "seq_len": 32, "micro_batch_size": 4, "global_batch_size": 8}})
    with pytest.raises(ValueError, match="model.n_kv_heads=2 .2 per tp rank. is not divisible by cp=8"):
        LifecycleConfig.model_validate({**tiny(nproc_per_node=8, cp=8, cp_impl="ulysses"), "pretrain": {
            "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 8}})
    LifecycleConfig.model_validate(tiny(nproc_per_node=2, pp=2, pp_split=[3, 1]))
