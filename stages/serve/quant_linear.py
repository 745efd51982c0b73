"""Quantized weights kept quantized in memory and dequantized on the fly, one linear at a time.

Two families, both read straight from the files the export stage writes:

  Int4GroupWeight   compressed-tensors `pack-quantized` (W4A16): `weight_packed` int32 [out, in/8] (eight
                    4-bit values per word, value j at bits 4j..4j+3, stored as q + 8) and `weight_scale`
                    [out, in/group], w = q * scale per group of `group` inputs.
  Int8ChannelWeight compressed-tensors `int-quantized` W8A8: `weight` int8 [out, in] and `weight_scale` [out, 1],
                    w = q * scale per output row. With the config's dynamic per-token int8 input activations
                    (what vLLM's CompressedTensorsW8A8Int8 runs) each row of the input is rounded to int8
                    with its own scale max|x_row| / 127 first, and the product of the two int8 matrices is
                    scaled back: y = (q_x q_w^T) * s_x * s_w^T, as the int8 GEMM computes it.
  GGUFBlockWeight   ggml Q8_0 / Q4_0 blocks of 32 weights along a row: one fp16 scale `d` per block and
                    32 int8 values (Q8_0) or 16 bytes of nibbles, low nibbles first (Q4_0, q - 8), w = q * d.
                    Kept as the block's two parts (scales [rows, blocks], quants [rows, bytes]): the same
                    bytes as the file, split so a forward needs no strided reads.

Each is a "tensor-like" object (torch's `__torch_function__` protocol): the model's forward calls
`F.linear(x, W, b)` and `embed[ids]` exactly as for a plain tensor, and the weight dequantizes itself
(per forward, into the activation's dtype, through float32 so the values equal the reference
dequantizer's bit for bit) just for that call. `torch.cat` of weights of one kind along the output rows
gives a fused weight (q/k/v, gate/up), still quantized. Seed: "INT4 weight-only quantization (AWQ, GPTQ)
quarters memory for bandwidth-bound serving" -- the resident bytes are what `nbytes` reports.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

_LINEAR = {F.linear, torch._C._nn.linear}


class QuantizedWeight:
    """Base: a [out, in] weight held quantized; `dtype` is the compute dtype the model asked for."""

    shape: tuple[int, int]
    dtype: torch.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._parts())

    def _parts(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self._parts()[0].device

    def dim(self) -> int:
        return 2

    def contiguous(self) -> "QuantizedWeight":
        return self

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
            return self.rows(index)
        return self.dequantize()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LINEAR:
            x, w, *rest = args
            if "weight" in kwargs:
                w = kwargs.pop("weight")
            if isinstance(w, Int8ChannelWeight):
                return w.linear(x, *rest, **kwargs)
            return func(x, w.dequantize(x.dtype), *rest, **kwargs)
        if func is torch.cat:
            tensors = args[0] if args else kwargs.pop("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if dim != 0 or not all(type(t) is type(tensors[0]) for t in tensors):
                raise TypeError(f"quantized weights concatenate only along the output rows (dim 0) and with "
                                f"their own kind; got dim={dim}, kinds {[type(t).__name__ for t in tensors]}")
            return type(tensors[0]).concat_rows(list(tensors))
        # anything else (a new use in the model's forward) gets the dequantized weight: correct, just not packed
        def plain(a):
            return a.dequantize() if isinstance(a, QuantizedWeight) else a
        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, nbytes={self.nbytes})"


class Int4GroupWeight(QuantizedWeight):
    """compressed-tensors pack-quantized, symmetric, group-wise (see the module docstring)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
        out_f, in_f = shape
        if packed.dtype != torch.int32 or tuple(packed.shape) != (out_f, -(-in_f // 8)):
            raise ValueError(f"weight_packed must be int32 [{out_f}, {-(-in_f // 8)}] for shape {shape}; "
                             f"got {packed.dtype} {tuple(packed.shape)}")
        if scale.dim() != 2 or scale.shape[0] != out_f or in_f % scale.shape[1]:
            raise ValueError(f"weight_scale {tuple(scale.shape)} does not give whole groups of a {shape} weight")
        self.packed, self.scale, self.shape, self.dtype = packed, scale, (int(out_f), int(in_f)), dtype
        self.group = in_f // scale.shape[1]

    def _parts(self) -> list[torch.Tensor]:
        return [self.packed, self.scale]

    def to(self, device=None, dtype=None) -> "Int4GroupWeight":
        return Int4GroupWeight(self.packed.to(device), self.scale.to(device), self.shape, dtype or self.dtype)

    @classmethod
    def concat_rows(cls, ws: list["Int4GroupWeight"]) -> "Int4GroupWeight":
        if len({(w.shape[1], w.group) for w in ws}) != 1:
            raise ValueError(f"cannot fuse INT4 weights of different widths/groups: {[(w.shape, w.group) for w in ws]}")
        out_f = sum(w.shape[0] for w in ws)
        return cls(torch.cat([w.packed for w in ws]), torch.cat([w.scale for w in ws]), (out_f, ws[0].shape[1]),
                   ws[0].dtype)

    def _dequant(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, in_f = packed.shape[0], self.shape[1]
        if sys.byteorder == "little":
            # the word's bytes in memory order: byte k holds value 2k (low nibble) and 2k + 1 (high nibble);
            # unpacking bytes moves a quarter of the data of shifting whole int32 words (about 2x faster)
            b = packed.view(torch.uint8)
            q = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(rows, -1)
        else:
            shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
            # an arithmetic shift of a negative word drags its sign in from the left; the mask keeps the nibble
            q = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(rows, -1)
        # q - 8 is exact in float32: the same values as the reference's (q - 8).float() * scale
        w = (q[:, :in_f].float().reshape(rows, scale.shape[1], self.group) - 8) * scale.float().unsqueeze(-1)
        return w.reshape(rows, in_f).to(dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._dequant(self.packed, self.scale, dtype or self.dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self._dequant(self.packed[index.reshape(-1)], self.scale[index.reshape(-1)],
                             self.dtype).reshape(*index.shape, self.shape[1])


class Int8ChannelWeight(QuantizedWeight):
    """compressed-tensors int-quantized, symmetric per output channel; `int8_inputs`: W8A8 (see the module
    docstring), else the weight alone is quantized."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, int8_inputs: bool):
        if q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0], 1):
            raise ValueError(f"an int8 channel weight needs int8 [out, in] values and a [out, 1] scale; got "
                             f"{q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}")
        self.q, self.scale, self.dtype, self.int8_inputs = q, scale.float(), dtype, int8_inputs
        self.shape = (int(q.shape[0]), int(q.shape[1]))

    def _parts(self) -> list[torch.Tensor]:
        return [self.q, self.scale]

    def to(self, device=None, dtype=None) -> "Int8ChannelWeight":
        return Int8ChannelWeight(self.q.to(device), self.scale.to(device), dtype or self.dtype, self.int8_inputs)

    @classmethod
    def concat_rows(cls, ws: list["Int8ChannelWeight"]) -> "Int8ChannelWeight":
        if len({(w.shape[1], w.int8_inputs) for w in ws}) != 1:
            raise ValueError(f"cannot fuse int8 weights of different widths or input schemes: {[w.shape for w in ws]}")
        return cls(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]), ws[0].dtype, ws[0].int8_inputs)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.q.float() * self.scale).to(dtype or self.dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        flat = index.reshape(-1)
        return (self.q[flat].float() * self.scale[flat]).to(self.dtype).reshape(*index.shape, self.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.int8_inputs:
            return F.linear(x, self.dequantize(x.dtype), bias)
        xf = x.float()
        sx = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)  # vLLM's dynamic per-token scale
        qx = torch.round(xf / sx).clamp(-128, 127)
        # integer products summed in float32 (exact up to 2^24 per partial sum, then float rounding):
        # the int32-accumulating GEMM, emulated where no int8 matmul is at hand
        y = (qx @ self.q.float().T) * sx * self.scale.T
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


GGUF_BLOCK = 32  # weights per Q8_0 / Q4_0 block
GGUF_BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_0": 2 + 16}


class GGUFBlockWeight(QuantizedWeight):
    """ggml Q8_0 or Q4_0 blocks along each row (see the module docstring)."""

    def __init__(self, kind: str, d: torch.Tensor, qs: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
        if kind not in GGUF_BLOCK_BYTES:
            raise ValueError(f"unsupported GGUF block type {kind!r}; supported: {', '.join(GGUF_BLOCK_BYTES)}")
        out_f, in_f = shape
        nb = in_f // GGUF_BLOCK
        want_qs = (out_f, nb * (32 if kind == "Q8_0" else 16))
        if in_f % GGUF_BLOCK or tuple(d.shape) != (out_f, nb) or tuple(qs.shape) != want_qs:
            raise ValueError(f"{kind} blocks of a {shape} weight need scales {(out_f, nb)} and quants {want_qs}; "
                             f"got {tuple(d.shape)} and {tuple(qs.shape)}")
        self.kind, self.d, self.qs, self.shape, self.dtype = kind, d, qs, (int(out_f), int(in_f)), dtype

    @classmethod
    def from_raw(cls, kind: str, raw: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> "GGUFBlockWeight":
        """raw: uint8 [out, blocks * bytes per block], the rows exactly as the GGUF file stores them."""
        out_f, in_f = shape
        if in_f % GGUF_BLOCK:
            raise ValueError(f"{kind} weight rows of width {in_f} are not whole blocks of {GGUF_BLOCK}")
        blocks = raw.reshape(out_f, in_f // GGUF_BLOCK, GGUF_BLOCK_BYTES[kind])
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(out_f, -1)
        qs = blocks[..., 2:].contiguous()
        qs = (qs.view(torch.int8) if kind == "Q8_0" else qs).reshape(out_f, -1)
        return cls(kind, d, qs, shape, dtype)

    def _parts(self) -> list[torch.Tensor]:
        return [self.d, self.qs]

    def to(self, device=None, dtype=None) -> "GGUFBlockWeight":
        return GGUFBlockWeight(self.kind, self.d.to(device), self.qs.to(device), self.shape, dtype or self.dtype)

    def permute_rows(self, order: torch.Tensor) -> "GGUFBlockWeight":
        """Rows reordered (blocks run along a row, so a row permutation moves whole blocks: exact)."""
        return GGUFBlockWeight(self.kind, self.d[order], self.qs[order], self.shape, self.dtype)

    @classmethod
    def concat_rows(cls, ws: list["GGUFBlockWeight"]) -> "GGUFBlockWeight":
        if len({(w.kind, w.shape[1]) for w in ws}) != 1:
            raise ValueError(f"cannot fuse GGUF weights of different types/widths: {[(w.kind, w.shape) for w in ws]}")
        return cls(ws[0].kind, torch.cat([w.d for w in ws]), torch.cat([w.qs for w in ws]),
                   (sum(w.shape[0] for w in ws), ws[0].shape[1]), ws[0].dtype)

    def _dequant(self, d: torch.Tensor, qs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, nb = d.shape
        if self.kind == "Q8_0":
            q = qs.reshape(rows, nb, GGUF_BLOCK)
        else:  # byte i of a block holds value i (low nibble) and value i + 16 (high nibble)
            b = qs.reshape(rows, nb, GGUF_BLOCK // 2)
            q = torch.cat((b & 0xF, b >> 4), dim=-1).to(torch.int8) - 8
        return (q.float() * d.float().unsqueeze(-1)).reshape(rows, nb * GGUF_BLOCK).to(dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._dequant(self.d, self.qs, dtype or self.dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        flat = index.reshape(-1)
        return self._dequant(self.d[flat], self.qs[flat], self.dtype).reshape(*index.shape, self.shape[1])


def take_int4_weights(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Int4GroupWeight]:
    """Pull each `<base>.weight_packed` / `.weight_scale` / `.weight_shape` triple out of `sd` (in place) and
    return `<base>.weight` -> Int4GroupWeight. A packed weight missing its scale or shape fails naming it."""
    out: dict[str, Int4GroupWeight] = {}
    for name in [n for n in sd if n.endswith(".weight_packed")]:
        base = name[: -len(".weight_packed")]
        missing = [base + s for s in (".weight_scale", ".weight_shape") if base + s not in sd]
        if missing:
            raise KeyError(f"packed INT4 weight {name!r} has no {missing}")
        if base + ".weight_zero_point" in sd:
            raise ValueError(f"{base}: asymmetric INT4 (weight_zero_point) is not supported; export symmetric groups")
        shape = tuple(int(x) for x in sd.pop(base + ".weight_shape").tolist())
        out[base + ".weight"] = Int4GroupWeight(sd.pop(name), sd.pop(base + ".weight_scale"), shape, dtype)
    return out


def int8_inputs_of(quantization_config: dict | None) -> bool | None:
    """None unless the config is compressed-tensors int-quantized; then whether its inputs are dynamic
    per-token int8 (W8A8). Any other int8 input scheme (static, per tensor) is refused, naming it."""
    q = quantization_config or {}
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "int-quantized":
        return None
    acts = [g.get("input_activations") for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not any(acts):
        return False
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    for a in acts:
        got = {k: (a or {}).get(k) for k in want}
        if got != want:
            raise ValueError(f"int-quantized input activations {got} are not served; this engine serves {want}")
    return True


def take_int8_weights(sd: dict[str, torch.Tensor], dtype: torch.dtype,
                      int8_inputs: bool) -> dict[str, Int8ChannelWeight]:
    """Pull each int8 `<base>.weight` and its `.weight_scale` out of `sd` (in place)."""
    out: dict[str, Int8ChannelWeight] = {}
    for name in [n for n, t in sd.items() if n.endswith(".weight") and t.dtype == torch.int8]:
        scale = name[: -len("weight")] + "weight_scale"
        if scale not in sd:
            raise KeyError(f"int8 weight {name!r} has no {scale!r}")
        if name[: -len("weight")] + "weight_zero_point" in sd:
            raise ValueError(f"{name}: asymmetric int8 (weight_zero_point) is not supported; export symmetric channels")
        out[name] = Int8ChannelWeight(sd.pop(name), sd.pop(scale), dtype, int8_inputs)
    return out


def take_quantized(sd: dict, dtype: torch.dtype, quantization_config: dict | None = None) -> dict[str, QuantizedWeight]:
    """Every weight the model keeps quantized, pulled out of `sd` (in place): INT4 triples, int8 channel
    weights of an int-quantized config (W8A8 when it declares int8 inputs) and weights already built as
    QuantizedWeight (the GGUF loader's)."""
    out: dict[str, QuantizedWeight] = take_int4_weights(sd, dtype)
    int8_inputs = int8_inputs_of(quantization_config)
    if int8_inputs is not None:
        out.update(take_int8_weights(sd, dtype, int8_inputs))
    for name in [n for n, v in sd.items() if isinstance(v, QuantizedWeight)]:
        out[name] = sd.pop(name)
        out[name].dtype = dtype
    return out


def weight_bytes(weights) -> int:
    """Resident bytes of tensors and quantized weights (shared objects counted once)."""
    seen, total = set(), 0
    for w in weights:
        if w is None or id(w) in seen:
            continue
        seen.add(id(w))
        total += w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
    return total
