"""Variant folders and texts the evaluate tests build by hand."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path


def write_broken_variant(hf: Path, dst: Path) -> None:
    """A folder the engine cannot load and no reader can dequantize: config + tokenizer, bogus weights."""
    import torch
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for f in hf.iterdir():
        if f.suffix == ".json" and not f.name.startswith("model"):  # config and tokenizer files
            shutil.copy(f, dst / f.name)
    save_file({"model.layers.0.self_attn.q_proj.weight_packed": torch.zeros(4, 4, dtype=torch.int32)},
              str(dst / "model.safetensors"))


def stdlib_sources(n: int) -> list[str]:
    """The first n modules of the standard library's source: real Python text, always on disk."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8") for p in sorted(root.glob("*.py"))[:n]]
