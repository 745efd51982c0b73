"""Fixtures of the evaluate tests: an export-shaped folder built from the tiny Hugging Face checkpoint
(hf/, FP8, packed INT4 and GGUF Q8_0 variants), a folder nothing can load, and a cleaned-data
artifact whose validation split holds real Python source."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# a uniquely named helper module, never `conftest`: several test folders have one
from eval_variants import stdlib_sources, write_broken_variant  # noqa: F401


def write_fp8_variant(src: Path, dst: Path) -> None:
    """FP8 e4m3 weights with one scale per output channel (amax / 448), the layout the engine loads."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    out = {}
    for name, w in sd.items():
        if name.endswith("proj.weight"):
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
            out[name] = (w / scale[:, None]).to(torch.float8_e4m3fn)
            out[name[: -len(".weight")] + ".weight_scale"] = scale.float()
        else:
            out[name] = w
    save_file(out, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file() and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="session")
def export_dir(tiny_hf_model_dir, tmp_path_factory) -> Path:
    """hf/ plus quantized variants in the export stage's layouts, written with its own functions: FP8,
    packed INT4 and GGUF Q8_0, each loaded by the engine from its own files."""
    import json

    from safetensors.torch import save_file

    from stages.export.gguf_export import write_gguf
    from stages.export.hf import from_hf_state_dict, model_config_from_hf, read_safetensors
    from stages.export.quantize import quantization_config, quantize_state_dict

    root = tmp_path_factory.mktemp("export")
    hf = root / "hf"
    shutil.copytree(tiny_hf_model_dir, hf)
    write_fp8_variant(hf, root / "quantized" / "fp8")
    conf = json.loads((hf / "config.json").read_text())
    tensors = read_safetensors(hf)
    int4 = root / "quantized" / "int4"
    int4.mkdir(parents=True)
    save_file(quantize_state_dict(tensors, "int4", group=128), str(int4 / "model.safetensors"))
    (int4 / "config.json").write_text(json.dumps({**conf, "quantization_config": quantization_config("int4", 128)}))
    for f in hf.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, int4 / f.name)
    cfg, arch = model_config_from_hf(conf)
    gguf = root / "quantized" / "gguf-q8_0"
    gguf.mkdir(parents=True)
    write_gguf(from_hf_state_dict(tensors, cfg, arch), cfg, gguf / "model.gguf", "gguf-q8_0", tokenizer_dir=hf)
    for f in hf.iterdir():  # the export stage copies the tokenizer beside model.gguf too
        if f.name.startswith("tokenizer"):
            shutil.copy(f, gguf / f.name)
    return root


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The data stage's output layout (validation/part-*.parquet with a `text` column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("data")
    texts = stdlib_sources(12)
    for split, part in (("train", texts[:2]), ("validation", texts[2:])):
        (root / split).mkdir()
        table = pa.table({"id": [str(i) for i in range(len(part))], "source": ["python"] * len(part),
                          "origin": ["stdlib"] * len(part), "text": part})
        pq.write_table(table, root / split / "part-00000.parquet")
    return root
