"""torch.compile applied per transformer block (TorchTitan: every block has the same graph, so one
compilation serves all of them, and a graph break stays inside a block). `nn.Module.compile`
compiles in place, keeping parameter names."""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> None:
    for block in model.layers.values():
        block.compile(fullgraph=False)
