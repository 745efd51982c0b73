"""Shipping a prefilled request's K/V from one engine to another (prefill/decode disaggregation:
seed, serving techniques, "run them on separate GPU pools and ship the KV cache between them").

The prefill engine runs the prompt with max_tokens=1 (as vLLM's disaggregated proxy does), keeps the
request's full prompt blocks referenced when it finishes (`LLMEngine.add_request(hold_kv=True)`),
and `export_kv` packs them into a self-describing payload: safetensors bytes holding every layer's
K and V of those blocks (`kv`: [layers, 2, kv_heads, blocks, block_size, head_dim], plus `kv_scale`
for an FP8 cache) and a JSON header with the model's shape and weights fingerprint, the cache dtype,
the block size, the prompt's token ids, the blocks' chained hashes, and the request's state (its
first sampled token, its logprobs; its seeded generator's state as a tensor). Bytes, never Python
references, so the same payload could go over a socket or through the object store.

`import_kv` checks the header against the importing engine (any mismatch -> `KVTransferError`
naming each field) and writes the blocks into its pool as prefix-cache entries: fresh blocks, K/V
copied in, hashes registered, then freed, so they sit unreferenced and evictable like any cached
block. When the request arrives there (its prompt plus the first token: a prefix lookup always
leaves one token to compute, so with that token appended a prompt of whole blocks hits them all), its
prompt's full blocks are prefix-cache hits and only the tail (the partial last block, fewer than block_size tokens, and
the first token) is computed again.

This is the LMCache style ("KV via the prefix cache"): nothing in the scheduler changes, the
decode engine finds the K/V by the same chained hashes as a local prefix hit, and a payload that
arrives late or is evicted before the request is admitted only costs recomputation. What is not
shipped is the partial last block. Handing it over directly (so the decode engine computes nothing
of the prompt) would additionally need: its K/V in the payload; on the decode side a block for it
that is not put in the hash map (later tokens are written into it, so it must not be shared),
allocated when the request arrives and filled before its first step; and a scheduler hook that
admits the request with a computed-token count that is not block-aligned (vLLM's connector reports
such "external" tokens to its scheduler and parks the request until their K/V have landed).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .kv_cache import prefix_block_hashes
from .sampling import TokenLogprob

if TYPE_CHECKING:
    from .engine import LLMEngine, PrefilledRequest

FORMAT = "eightfold-kv/1"
HEADER_KEY = "eightfold.kv_transfer"


class KVTransferError(ValueError):
    """A payload that does not fit the importing engine (another model, shape, dtype, block size)
    or is damaged."""


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """Cheap identity of a checkpoint folder's weights: config.json, and each weight file's name,
    size and first and last MiB (K/V computed by other weights must not be imported)."""
    d = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    files = sorted([d / "config.json"] if (d / "config.json").exists() else [])
    files += sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()


def kv_layout(engine: "LLMEngine") -> dict:
    """What must agree between the exporting and the importing engine."""
    shape = engine.model.shape
    return {
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "block_size": engine.kv.block_size,
        "dtype": engine.config.dtype,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "weights": engine.weights_fingerprint(),
    }


def layout_diffs(theirs: dict, mine: dict, their_name: str, my_name: str) -> list[str]:
    """Every field of `kv_layout` where two layouts differ, named."""
    return [f"{k} {theirs.get(k)!r} ({their_name}) != {v!r} ({my_name})" for k, v in mine.items() if theirs.get(k) != v]


def check_layout(payload_layout: dict, engine: "LLMEngine") -> None:
    """Raise KVTransferError naming every field where the payload and the engine differ."""
    diffs = layout_diffs(payload_layout, kv_layout(engine), "payload", f"engine {engine.model_name}")
    if diffs:
        raise KVTransferError("KV payload does not fit this engine: " + "; ".join(diffs))


@dataclass
class KVPayload:
    """One request's exported K/V: the JSON header and the tensors."""

    header: dict
    kv: torch.Tensor  # [layers, 2, kv_heads, blocks, block_size, head_dim], the cache's dtype
    kv_scale: torch.Tensor | None = None  # FP8 cache: [layers, 2, kv_heads, blocks, block_size, 1]
    generator_state: torch.Tensor | None = None  # uint8, the request's seeded generator after its first sample

    @property
    def block_hashes(self) -> list[bytes]:
        return [bytes.fromhex(x) for x in self.header["block_hashes"]]

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.header["prompt_token_ids"])

    def prefilled(self) -> "PrefilledRequest":
        """The request's state after the prefill engine, for `LLMEngine.add_prefilled_request`."""
        from .engine import PrefilledRequest

        r = self.header["request"]
        lps = [TokenLogprob(int(t), float(lp), {int(k): float(v) for k, v in top}, None if rank is None else int(rank))
               for t, lp, top, rank in r["logprobs"]]
        return PrefilledRequest(list(r["output_token_ids"]), lps, self.generator_state)

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {"kv": self.kv.contiguous()}
        if self.kv_scale is not None:
            tensors["kv_scale"] = self.kv_scale.contiguous()
        if self.generator_state is not None:
            tensors["generator_state"] = self.generator_state.contiguous()
        return save(tensors, metadata={HEADER_KEY: json.dumps(self.header)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVPayload":
        from safetensors.torch import load

        # the safetensors layout: 8-byte little-endian header length, then the JSON header
        if len(data) < 8:
            raise KVTransferError(f"KV payload of {len(data)} bytes is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", data[:8])
        try:
            meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
            header = json.loads(meta[HEADER_KEY])
        except (ValueError, KeyError, AttributeError) as e:
            raise KVTransferError(f"not an eightfold KV payload (no {HEADER_KEY!r} header): {e}") from e
        if header.get("format") != FORMAT:
            raise KVTransferError(f"KV payload format {header.get('format')!r}, expected {FORMAT!r}")
        t = load(data)
        return cls(header, t["kv"], t.get("kv_scale"), t.get("generator_state"))


def _block_view(cache_layer: torch.Tensor, block_size: int) -> torch.Tensor:
    """[2, kv_heads, num_blocks * block_size, head_dim] -> [2, kv_heads, num_blocks, block_size, head_dim]."""
    two, kvh, slots, d = cache_layer.shape
    return cache_layer.view(two, kvh, slots // block_size, block_size, d)


def read_blocks(engine: "LLMEngine", block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The K/V (and FP8 scales) of blocks, on the CPU: [layers, 2, kv_heads, n, block_size, head_dim]."""
    cache, bs = engine.cache, engine.kv.block_size
    idx = torch.tensor(block_ids, dtype=torch.long, device=engine.model.device)
    kv = torch.stack([_block_view(x, bs).index_select(2, idx) for x in cache.kv]).cpu()
    scale = torch.stack([_block_view(x, bs).index_select(2, idx) for x in cache.scale]).cpu() if cache.fp8 else None
    return kv, scale


def export_kv(engine: "LLMEngine", request_id: str) -> KVPayload:
    """The payload of a finished request whose blocks the engine held (`add_request(hold_kv=True)`);
    the held blocks are released afterwards."""
    held = engine.held_kv.get(request_id)
    if held is None:
        raise KeyError(f"request {request_id!r} has no K/V held on engine {engine.model_name} "
                       "(not added with hold_kv=True, not finished yet, or aborted)")
    try:
        req = held.request
        kv, scale = read_blocks(engine, [b.block_id for b in held.blocks])
        gen = req.generator.get_state() if req.generator is not None else None
        header = {
            "format": FORMAT,
            "model": engine.model_name,
            "layout": kv_layout(engine),
            "num_blocks": len(held.blocks),
            "prompt_token_ids": list(req.prompt_token_ids),
            "block_hashes": [h.hex() for h in held.block_hashes],
            "request": {
                "output_token_ids": list(req.output_token_ids),
                "logprobs": [[lp.token_id, lp.logprob, [[k, v] for k, v in lp.top.items()], lp.rank]
                             for lp in req.logprobs],
            },
        }
        return KVPayload(header, kv, scale, gen)
    finally:
        engine.release_held_kv(request_id)


@dataclass
class ImportResult:
    num_blocks: int  # full prompt blocks in the payload
    num_imported: int  # of which written into the pool
    num_already_cached: int  # of which the pool already held (same hash)


def import_kv(engine: "LLMEngine", payload: KVPayload) -> ImportResult:
    """Write the payload's blocks into `engine`'s pool as cached, unreferenced blocks."""
    h = payload.header
    check_layout(h.get("layout") or {}, engine)
    if not engine.kv.enable_prefix_caching:
        raise KVTransferError(f"engine {engine.model_name} has prefix caching off: imported K/V would never be found")
    n, bs = h["num_blocks"], engine.kv.block_size
    hashes = payload.block_hashes
    shape = engine.model.shape
    want = (shape.num_layers, 2, shape.num_kv_heads, n, bs, shape.head_dim)
    if tuple(payload.kv.shape) != want or len(hashes) != n:
        raise KVTransferError(f"KV payload tensor {tuple(payload.kv.shape)} with {len(hashes)} hashes does not "
                              f"match its header ({n} blocks: expected {want})")
    if prefix_block_hashes(payload.prompt_token_ids, bs, n) != hashes:
        raise KVTransferError("KV payload's block hashes do not match its prompt token ids (damaged payload)")
    pool = engine.kv.pool
    found = [pool.lookup(x) for x in hashes]
    kept = [b for b in found if b is not None]
    pool.touch(kept)  # out of the free queue while new blocks are taken: not evicted under us
    missing = [i for i, b in enumerate(found) if b is None]
    # a block is useful only after all those before it: stop at the first one the pool cannot take
    num_new = min(len(missing), pool.num_free)
    new = pool.get_new_blocks(num_new)
    src = missing[:num_new]
    if new:
        dev = engine.model.device
        dst = torch.tensor([b.block_id for b in new], dtype=torch.long, device=dev)
        sel = torch.tensor(src, dtype=torch.long)
        for layer, x in enumerate(engine.cache.kv):
            _block_view(x, bs)[:, :, dst] = payload.kv[layer].index_select(2, sel).to(dev)
        if engine.cache.fp8:
            if payload.kv_scale is None:
                raise KVTransferError("FP8 KV payload without its scales")
            for layer, x in enumerate(engine.cache.scale):
                _block_view(x, bs)[:, :, dst] = payload.kv_scale[layer].index_select(2, sel).to(dev)
        for i, b in zip(src, new):
            pool.cache_block(b, hashes[i])
    # released in reverse prompt order: the tail blocks are evicted first, as KVCacheManager.free does
    order = {id(b): i for i, b in enumerate(found) if b is not None}
    order.update({id(b): i for i, b in zip(src, new)})
    pool.free(sorted(kept + new, key=lambda b: -order[id(b)]))
    return ImportResult(n, len(new), len(kept))
