"""Multi-LoRA serving: PEFT adapters applied per row inside the batched forward (S-LoRA; vLLM's punica
kernels), so requests for different adapters and for the base model share one step.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors: what PEFT's
`save_pretrained` and the export stage, stages/export/peft_adapter.py, write). Loading lays its factors
out for the model's fused projections (model.py fuses q/k/v into `qkv` and gate/up into `gate_up`): per
layer and fused projection, the A of every adapted slice stacked ([sum of ranks, in]) and one B per
slice with the output rows it adds to.

A step whose rows use adapters (`LoRAStep`, built from the runs of rows each sequence contributes to the
flat batch) groups the rows by adapter -- one contiguous slice when they are, an index otherwise (SGMV's
segments). Each adapted projection's weight is handed to the model's unchanged math as a `LoRALinear`:
`F.linear` through it computes the base projection for every row, then for each adapter
  shrink:  y = x[rows] @ A_stacked^T             (one matmul for all of the projection's slices)
  expand:  out[rows, slice] += (y[:, its ranks] @ B^T) * scaling     (one per output slice)
which is PEFT's `result + lora_B(lora_A(x)) * scaling` for that module (same order of operations,
A then B then the scale) and vLLM's `add_shrink` / `add_expand` with output slices. Base-model rows cost
nothing beyond the base matmul; a step with no adapter rows takes the plain path untouched (compiled
decode steps included).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

_LINEAR = {F.linear, torch._C._nn.linear}
# PEFT options that change what the adapter computes beyond W x + s B A x: refused, not half-applied
UNSUPPORTED_OPTIONS = ("use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                       "layer_replication", "trainable_token_indices", "target_parameters", "alora_invocation_tokens",
                       "use_qalora", "use_bdlora", "velora_config", "monteclora_config", "arrow_config", "kasa_config")
_uids = itertools.count(1)  # per load: a name loaded again (other weights) gets a new prefix-cache salt


class LoRAError(ValueError):
    """The folder is not an adapter this model can serve (the message names what is wrong)."""


@dataclass
class LoRAProjection:
    """One adapter's factors on one fused projection of one layer."""

    a: torch.Tensor  # [sum of slice ranks, in]: every adapted slice's A, stacked (the shrink)
    slices: list[tuple[int, int, int, int, torch.Tensor]]  # (out0, out1, rank0, rank1, B [out1-out0, rank1-rank0])
    scaling: float

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: slice | torch.Tensor | None) -> None:
        """out[rows] += this adapter's update of x[rows] (rows: all, a slice, or an index)."""
        xs = x if rows is None else x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        y = xs @ self.a.T
        for o0, o1, r0, r1, b in self.slices:
            delta = (y[:, r0:r1] @ b.T) * self.scaling
            if rows is None:
                out[:, o0:o1] += delta
            elif isinstance(rows, slice):
                out[rows, o0:o1] += delta
            else:
                out[:, o0:o1].index_add_(0, rows, delta)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    layers: list[dict[str, LoRAProjection]]  # per layer: fused projection name (qkv, o, gate_up, down) -> factors
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def cache_salt(self) -> bytes:
        """Mixed into the first block's hash: a prefix under this adapter is not a prefix under another
        (or under the base model), and not under this name's earlier weights either."""
        return b"lora\0%d\0" % self.uid + self.name.encode()

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + sum(s[4].numel() * s[4].element_size() for s in p.slices)
                   for layer in self.layers for p in layer.values())


def fused_slices(shape) -> dict[str, tuple[str, int, int, int]]:
    """PEFT module name -> (our fused projection, first output row, last + 1, input width), from model.py's
    fusion: qkv = [q; k; v] (heads x head_dim rows each), gate_up = [gate; up]."""
    H, d, I = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    return {"q_proj": ("qkv", 0, q, H), "k_proj": ("qkv", q, q + kv, H), "v_proj": ("qkv", q + kv, q + 2 * kv, H),
            "o_proj": ("o", 0, H, q), "gate_proj": ("gate_up", 0, I, H), "up_proj": ("gate_up", I, 2 * I, H),
            "down_proj": ("down", 0, H, I)}


def load_lora_adapter(name: str, path: str | Path | tuple[dict, dict[str, torch.Tensor]], shape, dtype: torch.dtype,
                      device: torch.device) -> LoRAAdapter:
    """A PEFT LoRA folder, or its (adapter_config, tensors) already in memory (a trainer's sync), -> an adapter
    laid out for this model; LoRAError naming the problem for anything that does not fit (another
    architecture, a misshapen factor, an option it would silently drop), FileNotFoundError when the folder
    holds no adapter."""
    from stages.export.peft_adapter import PEFT_KEY, lora_scaling, read_adapter

    conf, tensors = path if isinstance(path, tuple) else read_adapter(path)
    if isinstance(path, tuple):
        path = "<memory>"
    if conf.get("peft_type") != "LORA":
        raise LoRAError(f"{path}: peft_type is {conf.get('peft_type')!r}; only LORA adapters are served")
    if conf.get("bias", "none") != "none":
        raise LoRAError(f"{path}: bias={conf['bias']!r} (trained biases) is not supported; only bias='none'")
    used = [k for k in UNSUPPORTED_OPTIONS if conf.get(k)]
    if used:
        raise LoRAError(f"{path}: adapter options {used} are not supported by this engine")
    rank = int(conf["r"])
    scaling = lora_scaling(conf)
    where = fused_slices(shape)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = PEFT_KEY.match(key)
        if m is None:
            raise LoRAError(f"{path}: tensor {key!r} is not a LoRA factor of a decoder layer's linear projection")
        layer_name, which = m.groups()
        _, idx, _, module = layer_name.split(".")
        li = int(idx)
        if li >= shape.num_layers or module not in where:
            raise LoRAError(f"{path}: tensor {key!r} adapts {layer_name}, which this model does not have")
        if shape.is_sparse(li) and where[module][0] in ("gate_up", "down"):
            raise LoRAError(f"{path}: tensor {key!r} adapts the MLP of layer {li}, a mixture-of-experts layer: "
                            "LoRA on experts is not supported")
        _, o0, o1, in_f = where[module]
        expect = (rank, in_f) if which == "A" else (o1 - o0, rank)
        if tuple(t.shape) != expect:
            raise LoRAError(f"{path}: tensor {key!r} has shape {tuple(t.shape)}, expected {expect} "
                            f"(r={rank}) for this model")
        parts.setdefault((li, module), {})[which] = t
    missing = [f"layers.{li}.{m}.lora_{w}" for (li, m), p in parts.items() for w in "AB" if w not in p]
    if missing or not parts:
        raise LoRAError(f"{path}: adapter is incomplete: missing {missing or 'every factor'}")

    layers: list[dict[str, LoRAProjection]] = [{} for _ in range(shape.num_layers)]
    for li in range(shape.num_layers):
        by_proj: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for module, (proj, o0, o1, _) in where.items():
            p = parts.get((li, module))
            if p is not None:
                by_proj.setdefault(proj, []).append((o0, o1, p["A"], p["B"]))
        for proj, items in by_proj.items():
            a = torch.cat([A for _, _, A, _ in items]).to(device=device, dtype=dtype).contiguous()
            slices = [(o0, o1, j * rank, (j + 1) * rank, B.to(device=device, dtype=dtype).contiguous())
                      for j, (o0, o1, _, B) in enumerate(items)]
            layers[li][proj] = LoRAProjection(a, slices, scaling)
    return LoRAAdapter(name, str(path), rank, scaling, layers)


class LoRALinear:
    """A projection's weight for one step that has adapter rows: `F.linear(x, w, b)` through it is the base
    projection of every row plus each adapter's update on its own rows. Tensor-like through torch's
    `__torch_function__` (as quant_linear.py's weights are), so the model's math is not rewritten."""

    def __init__(self, base, step: "LoRAStep", layer: int, proj: str):
        self.base, self.step, self.layer, self.proj = base, step, layer, proj

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _LINEAR:
            raise TypeError(f"a LoRA-adapted weight is only used through F.linear, not {func}")
        x, w, *rest = args
        if "weight" in kwargs:
            w = kwargs.pop("weight")
        out = func(x, w.base, *rest, **kwargs)
        for adapter, rows in w.step.groups:
            p = adapter.layers[w.layer].get(w.proj)
            if p is not None:
                p.add_to(out, x, rows)
        return out


class LoRAStep:
    """The adapters of one step's rows: (adapter, its rows) with rows None (every row), a slice (one
    contiguous run) or an index tensor."""

    def __init__(self, groups: list[tuple[LoRAAdapter, slice | torch.Tensor | None]]):
        self.groups = groups

    @classmethod
    def from_runs(cls, runs: Iterable[tuple[LoRAAdapter | None, int]], device: torch.device) -> "LoRAStep | None":
        """`runs`: (adapter or None for the base model, number of consecutive rows), in flat-batch
        order. None when no row uses an adapter (the step takes the plain path)."""
        spans: dict[int, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
        pos = 0
        for adapter, n in runs:
            if adapter is not None and n:
                _, s = spans.setdefault(adapter.uid, (adapter, []))
                if s and s[-1][1] == pos:
                    s[-1] = (s[-1][0], pos + n)
                else:
                    s.append((pos, pos + n))
            pos += n
        if not spans:
            return None
        groups: list[tuple[LoRAAdapter, slice | torch.Tensor | None]] = []
        for adapter, s in spans.values():
            if len(s) == 1:
                groups.append((adapter, None if s[0] == (0, pos) else slice(*s[0])))
            else:
                idx = np.concatenate([np.arange(a, b) for a, b in s])
                groups.append((adapter, torch.from_numpy(idx).to(device)))
        return cls(groups)

    def wrap(self, layer: int, proj: str, weight):
        """`weight` as a LoRALinear when some adapter of this step adapts it, else unchanged."""
        if any(proj in adapter.layers[layer] for adapter, _ in self.groups):
            return LoRALinear(weight, self, layer, proj)
        return weight
