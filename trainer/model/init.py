"""Initial weights as a pure function of (seed, parameter name, position in the parameter).

A parameter's rows are cut into blocks of about BLOCK_ELEMENTS values; each block is drawn from its own
CPU generator, seeded by (seed, name, block index). Any region of a parameter can then be generated
alone, block by block: a process that holds only a slice of a parameter computes exactly the values
the whole model holds there, without ever holding the whole tensor, and the values depend neither on
the device, nor on the order parameters are visited in, nor on what else the process holds.

The distributions are the model's (GPT-2 / Llama practice): N(0, init_std) for every matrix, the
projections that write into the residual stream (o_proj, down_proj) scaled by 1/sqrt(2 n_layers) so
the stream's variance does not grow with depth, ones for norm gains.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from infra.config.model import ModelConfig

BLOCK_ELEMENTS = 1 << 22  # values per generated block: 16 MB of fp32, whatever the parameter's size
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")


def initial_std(cfg: ModelConfig, name: str, ndim: int) -> float | None:
    """The standard deviation parameter `name` starts from (normal, mean 0), or None: ones (a norm gain)."""
    if ndim < 2:
        return None
    if name.endswith(RESIDUAL_OUTPUTS):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit seed per (seed, name, block): a hash, so neighbouring blocks' streams are unrelated."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_block(shape: Sequence[int], block_elements: int = BLOCK_ELEMENTS) -> int:
    """Whole rows (dim 0) per block: a function of the parameter's full shape only."""
    return max(1, block_elements // max(1, math.prod(shape[1:])))


@torch.no_grad()
def fill_initial(out: torch.Tensor, seed: int, name: str, shape: Sequence[int], std: float | None,
                 offset: Sequence[int] | None = None, block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """Write into `out` the initial values of parameter `name` (full shape `shape`) in the region that
    starts at `offset` (default: the origin) and has `out`'s shape. Values are drawn in fp32 on the CPU
    one block of rows at a time (only blocks the region touches) and copied (cast) into `out`."""
    if std is None:
        return out.fill_(1.0)
    offset = tuple(offset) if offset is not None else (0,) * len(shape)
    if len(offset) != len(shape) or out.dim() != len(shape):
        raise ValueError(f"{name}: region of rank {out.dim()} at offset {offset} in a parameter of shape {tuple(shape)}")
    if any(o + s > n for o, s, n in zip(offset, out.shape, shape)):
        raise ValueError(f"{name}: region {tuple(out.shape)} at {offset} lies outside the parameter {tuple(shape)}")
    if out.numel() == 0:
        return out
    per = rows_per_block(shape, block_elements)
    r0, r1 = offset[0], offset[0] + out.shape[0]
    inner = tuple(slice(o, o + s) for o, s in zip(offset[1:], out.shape[1:]))
    for b in range(r0 // per, (r1 - 1) // per + 1):
        b0, b1 = b * per, min((b + 1) * per, shape[0])
        gen = torch.Generator().manual_seed(block_seed(seed, name, b))
        block = torch.empty((b1 - b0, *shape[1:])).normal_(0.0, std, generator=gen)
        lo, hi = max(b0, r0), min(b1, r1)
        out[lo - r0 : hi - r0].copy_(block[(slice(lo - b0, hi - b0), *inner)])
    return out
