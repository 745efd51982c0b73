"""Decode attention on CPU, read in place from the decode-slot rows (decode_slots.py) by a small C
kernel (slot_attention.c), built once with the system's C compiler (the one inductor uses) into
`~/.cache/eightfold/kernels` (`EIGHTFOLD_CACHE` moves it) and loaded with ctypes.

Why not SDPA: on CPU, `scaled_dot_product_attention` runs a decode step as one small GEMM pair per
(KV head, sequence), ~5 us of overhead each, and computes every key up to the group's longest
context, masked or not (a decode group pads each row to its longest context: 1.8x the keys needed
under load). The kernel gives each query row exactly the keys it sees, with FMA vector loops and a
vectorised softmax (AVX2 where the CPU has it, checked at run time; plain C otherwise), two heads of a
query per pass over their keys. Measured per layer call (head_dim 32, 2 KV heads, GQA 2, contexts
16-336, one thread, SDPA -> kernel): 8 sequences 86 -> 18 us, 32 sequences 583 -> 101 us, 128 sequences
2.99 -> 1.04 ms (their keys no longer fit the L3 cache). The engine at concurrency 32 went from ~6,100 to
~9,400 output tokens/s with the kernel's first version, and 3-5% further with the vectorised softmax (A/B
in one process). Its outputs match SDPA's within float32 rounding (~1e-6).

Used for float32 decode-slot groups of two sequences or more on CPU (decode_slots._slot_group): a lone
sequence, other groups, dtypes and devices keep SDPA, and so does every step where the kernel cannot
be built (a warning says why) or `EIGHTFOLD_SLOT_KERNEL=0` is set. A torch custom op, so the compiled
step (compiled_forward.py) calls it inside its graph.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from . import cache_root

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("slot_attention.c")
FLAGS = ["-O3", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": the loaded kernel, or None once it could not be


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _build():
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    lib = cache_dir() / f"slot_attention-{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        done = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, timeout=300)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise OSError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: processes building at once each write their own, the last one stays
    fn = ctypes.CDLL(str(lib)).slot_attention
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_float, p]
    fn.restype = None
    return fn


def kernel():
    """The loaded kernel, or None where it cannot be built here (or is turned off)."""
    if "fn" not in _state:
        with _lock:
            if "fn" not in _state:
                fn = None
                if os.environ.get("EIGHTFOLD_SLOT_KERNEL", "1") != "0":
                    try:
                        fn = _build()
                    except (OSError, subprocess.SubprocessError) as e:
                        log.warning("decode attention runs on SDPA: the slot kernel is unavailable (%s)", e)
                _state["fn"] = fn
    return _state["fn"]


def usable(slot_kv: list[torch.Tensor]) -> bool:
    """Whether these decode slots ([2, kv_heads, slots, capacity, head_dim] per layer) can be read by the kernel."""
    kv = slot_kv[0]
    return (kv.device.type == "cpu" and kv.dtype == torch.float32 and kv.stride(4) == 1
            and kv.stride(3) == kv.shape[4] and kernel() is not None)


@torch.library.custom_op("eightfold::slot_attention", mutates_args=())
def slot_attention(q: torch.Tensor, kv: torch.Tensor, slot_lo: int, key_lengths: torch.Tensor, group: int,
                   scale: float) -> torch.Tensor:
    """q [kv_heads, S, Q*group, head_dim] (a sequence's query rows query-major, each query's heads that
    share a KV head together); kv: one layer's decode slots [2, kv_heads, slots, capacity, head_dim],
    the sequences in slots slot_lo..slot_lo+S-1; key_lengths [S, Q]: the keys each query sees (its
    position + 1). Returns the attention, shaped like q."""
    q, lengths = q.contiguous(), key_lengths.contiguous()
    H, S, R, D = q.shape
    out = torch.empty_like(q)
    scratch = torch.empty(2 * kv.shape[3], dtype=torch.float32)  # two rows' scores: at most their capacity each
    fn = kernel()
    assert fn is not None and lengths.dtype == torch.int64, "check `usable` first; key_lengths are int64"
    k = kv.data_ptr() + slot_lo * kv.stride(2) * 4  # float32: 4 bytes
    fn(q.data_ptr(), k, k + kv.stride(0) * 4, lengths.data_ptr(), out.data_ptr(), H, S, R, D, group,
       kv.stride(1), kv.stride(2), scale, scratch.data_ptr())
    return out


@slot_attention.register_fake
def _(q, kv, slot_lo, key_lengths, group, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
