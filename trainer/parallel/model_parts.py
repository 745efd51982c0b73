"""Where the parallel plans go in the module being trained. Pretraining trains one Transformer; post-training
may train a module that holds Transformers as submodules (a reward model's trunk under its score head, PPO's
policy and value model). Each Transformer is planned as in pretraining (tensor-parallel plan, FSDP units,
activation checkpointing, compile per block); what lies outside them (small heads) is replicated."""

from __future__ import annotations

from torch import nn

from ..model import Transformer


def transformers_of(module: nn.Module) -> list[Transformer]:
    """The Transformers `module` is or holds (outermost ones only, each once), in module order."""
    found: dict[int, Transformer] = {}

    def visit(m: nn.Module) -> None:
        if isinstance(m, Transformer):
            found.setdefault(id(m), m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return list(found.values())


def modules_outside_transformers(module: nn.Module) -> dict[str, nn.Module]:
    """name -> every module outside the Transformers that holds parameters of its own (a head)."""
    out: dict[str, nn.Module] = {}

    def visit(prefix: str, m: nn.Module) -> None:
        if isinstance(m, Transformer):
            return
        if next(m.parameters(recurse=False), None) is not None:
            out.setdefault(prefix, m)
        for name, child in m.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", module)
    return out
