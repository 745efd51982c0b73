"""torch.compile applied per transformer block (TorchTitan: every block has the same graph, so one
compilation serves all of them, and a graph break stays inside a block). `nn.Module.compile`
compiles in place, keeping parameter names."""

from __future__ import annotations

from torch import nn

from .model_parts import transformers_of


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """`backend`: torch.compile's; a benchmark's dry run passes "aot_eager" (the same graph capture,
    forward and backward, without code generation)."""
    for block in (b for trunk in transformers_of(model) for b in trunk.layers.values()):
        block.compile(fullgraph=False, backend=backend)
