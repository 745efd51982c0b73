"""Where the pipeline cuts the model: layers per chunk (`parallel.pp_split`, or `auto`, which balances
the estimated FLOPs of every chunk with the head's 6*V*D per token counted on the last,
trainer.estimate.formulas.split_layers), the chunks each pp rank holds (loop style for GPipe, 1F1B and
interleaved 1F1B/zero-bubble: rank r holds r, r+p, ...; V style for ZBV and DualPipeV: r and 2p-1-r),
and a chunk as a module: the same Transformer class holding a subset of the layers (TorchTitan's
approach)."""

from __future__ import annotations

from torch import nn

from infra.config.parallel import ParallelConfig

from ..estimate import formulas
from ..model import Transformer

V_STYLE = ("zbv", "dualpipev")


def chunk_layer_counts(model_cfg, parallel: ParallelConfig, seq_len: int) -> list[int]:
    """Layers per pipeline chunk (pp * virtual stages chunks), from the config or balanced on FLOPs."""
    chunks = parallel.pp * parallel.pp_virtual_stages
    if isinstance(parallel.pp_split, list):
        counts = list(parallel.pp_split)
        if len(counts) != chunks or sum(counts) != model_cfg.n_layers or min(counts) < 1:
            raise ValueError(f"parallel.pp_split={counts}: need {chunks} chunks of >= 1 layer summing to "
                             f"model.n_layers={model_cfg.n_layers}")
        return counts
    q_dim = model_cfg.n_heads * model_cfg.head_size
    # Per token: 6 x active layer parameters + attention (12 s q_dim); the head 6 V D on the last chunk.
    costs = [6 * x["active"] + 12 * seq_len * q_dim for x in formulas.model_layer_params(model_cfg)]
    return formulas.split_layers(costs, chunks, last_extra=6 * model_cfg.vocab_size * model_cfg.dim)


def chunks_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule in V_STYLE:
        if virtual != 2:
            raise ValueError(f"pp_schedule={schedule} needs pp_virtual_stages=2, got {virtual}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def stage_module(model: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """A Transformer holding the given layers of `model` (shared, not copied)."""
    part = Transformer.__new__(Transformer)
    nn.Module.__init__(part)
    part.cfg = model.cfg
    part.embed_tokens = model.embed_tokens if first else None
    part.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    part.norm = model.norm if last else None
    part.lm_head = model.lm_head if last else None
    part.mtp = None  # MTP with pp > 1 is refused (infra.config.parallel.unsupported_layout)
    return part
