"""Weight quantization of a Hugging Face state dict, written in compressed-tensors layouts (what vLLM
loads), and the reference dequantizer for each (what our tests and engine use to read them back).

Seed: "FP8 weights and activations with per-channel scales are close to lossless on H100-class GPUs.
INT4 weight-only quantization (AWQ, GPTQ) quarters memory for bandwidth-bound serving."

  fp8       `float-quantized`: weight float8_e4m3fn [out, in] + weight_scale [out, 1], symmetric
            per output channel, scale = max|w_row| / 448; inputs declared dynamic per-token FP8 (W8A8).
  int8      `int-quantized` W8A8: weight int8 + weight_scale [out, 1], symmetric per output channel, inputs
            declared dynamic per-token int8 (compressed-tensors' W8A8 preset, scales and int8 values made by
            its own calculate_qparams and IntQuantizationCompressor: scale = max|w_row| / 127.5, round to
            nearest, clamp to [-128, 127]). This is the scheme vLLM's compressed-tensors selection
            serves with an int8 kernel (vllm/model_executor/layers/quantization/compressed_tensors/
            compressed_tensors.py: `_get_scheme_from_parts` -> `_is_dynamic_token_w8a8` ->
            CompressedTensorsW8A8Int8). Without input activations, an `int-quantized` group with int
            weights fails there already while parsing: `_quantization_scheme_map_from_config` asserts that
            an activation-quantization format with no input_activations has float weights.
  int4      `pack-quantized`: weight_packed int32 [out, in/8] (eight 4-bit values per int32, value j of a
            word at bits 4j..4j+3, stored as q + 8), weight_scale [out, in/group] (one scale per `group`
            inputs, max|w| / 7, symmetric, round to nearest), weight_shape int64 [2] (W4A16).
  int4-awq  the same layout after activation-aware scaling (awq.py): the file format does not change.

Only the linear layers inside the decoder blocks are quantized; embeddings, the LM head, norms and MoE
routers stay in the export dtype and are listed in `ignore`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
QUANTIZED = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj"
    r"|(mlp|block_sparse_moe)\.((experts\.\d+|shared_expert)\.)?(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$"
)
IGNORE = ["lm_head", "re:.*embed_tokens.*", "re:.*norm.*", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$",
          "re:.*shared_expert_gate$"]


def is_quantized_linear(name: str) -> bool:
    return QUANTIZED.match(name) is not None


# -- one tensor ----------------------------------------------------------------------------------


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn weight, float32 scale [out, 1]) with w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def int8_w8a8_scheme():
    """compressed-tensors' W8A8 preset on every Linear: int8 weights, symmetric per channel, static;
    int8 inputs, symmetric per token, dynamic."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    scheme.format = CompressionFormat.int_quantized.value
    return scheme


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 weight, float32 scale [out, 1]) as compressed-tensors writes W8A8 weights:
    its calculate_qparams (scale = max|w_row| / 127.5) and IntQuantizationCompressor (round to nearest,
    clamp to [-128, 127]); |q * scale - w| <= scale / 2 elementwise."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = int8_w8a8_scheme()
    w = w.float()
    scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), scheme.weights)
    q = IntQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)["weight"]
    return q, scale


def int4_groupwise(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 values in [-8, 7] of shape [out, in], float32 scale [out, in/group])."""
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f"input width {in_f} is not a multiple of the INT4 group size {group}")
    g = w.float().reshape(out_f, in_f // group, group)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 7.0).clamp_min(1e-12)
    q = torch.round(g / scale).clamp(-8, 7).to(torch.int8)
    return q.reshape(out_f, in_f), scale.squeeze(-1)


def dequant_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_f, in_f = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(out_f, groups, in_f // groups) * scale.float()[..., None]).reshape(out_f, in_f)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [rows, cols] -> int32 [rows, ceil(cols/8)]: value j of each group of eight
    at bits 4j..4j+3, offset by +8 to be unsigned (compressed-tensors' pack_to_int32 order)."""
    rows, cols = q.shape
    pad = (-cols) % 8
    u = (q.to(torch.int32) + 8)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(rows, -1, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    # Summing the shifted nibbles in int64 then wrapping to int32 keeps bit 31 (values >= 8 in slot 7).
    packed = (u.to(torch.int64) << shifts.to(torch.int64)).sum(dim=-1)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    p = packed.to(torch.int64) % 2**32  # the unsigned word
    shifts = torch.arange(8, dtype=torch.int64) * 4
    u = (p[..., None] >> shifts) & 0xF
    return (u.reshape(rows, -1)[:, :cols] - 8).to(torch.int8)


# -- whole state dicts -----------------------------------------------------------------------------


def quantize_state_dict(hf: dict[str, torch.Tensor], scheme: str, group: int = 128) -> dict[str, torch.Tensor]:
    """HF-named tensors -> the compressed-tensors tensors of `scheme` (fp8, int8, int4)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if not is_quantized_linear(name) or (scheme == "int4" and t.shape[1] % group):
            out[name] = t
            continue
        base = name[: -len(".weight")]
        if scheme == "fp8":
            q, s = fp8_per_channel(t)
            out[name], out[base + ".weight_scale"] = q, s
        elif scheme == "int8":
            q, s = int8_per_channel(t)
            out[name], out[base + ".weight_scale"] = q, s
        elif scheme == "int4":
            q, s = int4_groupwise(t, group)
            out[base + ".weight_packed"] = pack_int4(q)
            out[base + ".weight_scale"] = s
            out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            raise ValueError(f"unknown quantization scheme {scheme!r}; known: fp8, int8, int4")
    return out


def unquantized_linears(hf: dict[str, torch.Tensor], scheme: str, group: int) -> list[str]:
    """Linear layers a scheme leaves alone because of their shape (INT4: input width not a multiple of
    the group), to be listed in `ignore`."""
    if scheme != "int4":
        return []
    return [n[: -len(".weight")] for n, t in hf.items() if is_quantized_linear(n) and t.shape[1] % group]


def quantization_config(scheme: str, group: int = 128, fp8_activations: bool = True,
                        extra_ignore: list[str] | None = None) -> dict[str, Any]:
    """config.json's `quantization_config` (compressed-tensors) for a scheme."""
    ignore = IGNORE + list(extra_ignore or [])
    if scheme == "fp8":
        fmt = "float-quantized"
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True} \
            if fp8_activations else None
    elif scheme == "int8":  # W8A8, written by compressed-tensors' own config classes
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

        conf = QuantizationConfig(config_groups={"group_0": int8_w8a8_scheme()}, format="int-quantized",
                                  quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
        return conf.model_dump(mode="json")
    elif scheme == "int4":
        fmt = "pack-quantized"
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                   "dynamic": False, "actorder": None}
        acts = None
    else:
        raise ValueError(f"unknown quantization scheme {scheme!r}")
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def dequantize_state_dict(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any] | None,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The reference dequantizer: a compressed-tensors state dict (float-quantized, int-quantized,
    pack-quantized) -> plain `dtype` weights under the usual `.weight` names."""
    if not qcfg:
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    fmt = qcfg.get("format")
    if qcfg.get("quant_method") != "compressed-tensors" or fmt not in ("float-quantized", "int-quantized", "pack-quantized"):
        raise ValueError(f"unsupported quantization_config: quant_method={qcfg.get('quant_method')!r} format={fmt!r}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            continue
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            shape = tuple(int(x) for x in tensors[base + ".weight_shape"])
            q = unpack_int4(t, shape)
            out[base + ".weight"] = dequant_int4(q, tensors[base + ".weight_scale"]).to(dtype)
            continue
        scale = tensors.get(name[: -len(".weight")] + ".weight_scale") if name.endswith(".weight") else None
        if scale is not None:
            out[name] = (t.float() * scale.float()).to(dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def fake_quant_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """What vLLM's W8A8 int8 kernel does to its input (dynamic, symmetric, per token: its
    scaled_int8_quant takes scale = max|x_row| / 127 and rounds to nearest): the rounded values, in x's dtype."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
    return (torch.round(xf / scale).clamp(-128, 127) * scale).to(x.dtype)


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """What a W8A8 kernel does to its input: one FP8 scale per token (row), computed on the fly."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return ((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
