"""Bytes per variant, computed from the model's tensor shapes (seed: "Our toy shrinks from 20.4 GB of
training state to 2.5 GB of bf16 weights": 16 bytes of training state per parameter, 2 per bf16 weight).

Counted per tensor, with the same rules the writers use: only the decoder blocks' linear layers are
quantized; embeddings, LM head and norms stay in the export dtype (GGUF: F32 norms; Q4_0 keeps the
embedding and output at Q8_0). File headers and the index are not counted (kilobytes).
"""

from __future__ import annotations

import re

from infra.config.model import ModelConfig

TRAINING_STATE_BYTES = 16  # bf16 weight + bf16 grad + fp32 master + two fp32 Adam moments (seed)
LINEAR = re.compile(r"^layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.((experts\.\d+|shared_expert)\.)?(gate|up|down)_proj)\.weight$")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from .merge import expected_shapes

    shapes = {k: v for k, v in expected_shapes(cfg).items() if not k.endswith("expert_bias")}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def variant_bytes(cfg: ModelConfig, variant: str, dtype: str = "bfloat16", group: int = 128) -> int:
    """Weight bytes of one variant (`hf` = unquantized in `dtype`)."""
    base = DTYPE_BYTES[dtype]
    total = 0.0
    for name, shape in tensor_shapes(cfg).items():
        n = 1
        for s in shape:
            n *= s
        linear = LINEAR.match(name) is not None
        if variant == "hf" or (not linear and not variant.startswith("gguf")):
            total += n * base
        elif variant in ("fp8", "int8"):
            total += n + shape[0] * 4  # 1 byte each + a float32 scale per output channel
        elif variant in ("int4", "int4-awq"):
            total += n / 2 + shape[0] * (shape[1] // group) * 4 + 16 if shape[1] % group == 0 else n * base
        elif len(shape) == 1:
            total += n * 4  # GGUF norms in F32
        elif variant in ("gguf-f16", "gguf-bf16"):
            total += n * 2
        elif variant == "gguf-q8_0" or (variant == "gguf-q4_0" and not linear):
            total += n * 34 / 32  # 32 int8 + one fp16 scale
        elif variant == "gguf-q4_0":
            total += n * 18 / 32  # 32 nibbles + one fp16 scale
        else:
            raise ValueError(f"unknown variant {variant!r}")
    return int(round(total))


def size_rows(cfg: ModelConfig, variants: list[str], dtype: str = "bfloat16", group: int = 128,
              measured: dict[str, int] | None = None) -> list[dict]:
    from trainer.model import param_counts

    params = param_counts(cfg)["total"]
    rows = [{"variant": "training state", "bytes": params * TRAINING_STATE_BYTES, "measured_bytes": None,
             "bits_per_param": TRAINING_STATE_BYTES * 8.0}]
    for v in ["hf", *variants]:
        b = variant_bytes(cfg, v, dtype, group)
        rows.append({"variant": f"hf ({dtype})" if v == "hf" else v, "bytes": b,
                     "measured_bytes": (measured or {}).get(v), "bits_per_param": 8.0 * b / params})
    state = rows[0]["bytes"]
    for r in rows:
        r["params"] = params
        r["vs_training_state"] = r["bytes"] / state
    return rows


def _fmt(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def markdown(tables: dict[str, list[dict]]) -> str:
    out = []
    for title, rows in tables.items():
        out.append(f"### {title} ({rows[0]['params'] / 1e6:.2f}M parameters)\n")
        out.append("| variant | size (from shapes) | size on disk | bits/param | share of training state |")
        out.append("|---|---|---|---|---|")
        for r in rows:
            out.append(f"| {r['variant']} | {_fmt(r['bytes'])} | {_fmt(r['measured_bytes'])} | "
                       f"{r['bits_per_param']:.2f} | {r['vs_training_state']:.3f} |")
        out.append("")
    return "\n".join(out)
