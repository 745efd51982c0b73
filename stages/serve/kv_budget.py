"""How `kv_cache_memory_gb` is split between the paged block pool and the decode slots.

Both hold K/V: the pool every token of every request (the source of truth: prefix caching,
preemption, prefill), the decode slots (decode_slots.py) a second, contiguous copy of each decoding
request's context, `max_num_seqs` rows of one capacity. The budget pays for both: the slots' rows
are reserved first, the pool gets the rest, so pool bytes + slot bytes <= budget however far the
rows grow.

The rows' capacity: room for a whole context (max_model_len + 1 positions, decode_slots.py) when
the budget can hold that for every row and leave the pool at least as many tokens; otherwise the
rows and the pool get the same number of tokens. Equal is enough: a slot copies K/V that sit in the
pool, so when the running requests have similar lengths, any set of them the pool can hold fits the
rows. A request whose context outgrows its row decodes from the pool (runner.py), which is slower on
CPU, never wrong. The pool always keeps room for one request of max_model_len (vLLM refuses to start
without it); rows shorter than MIN_SLOT_ROW tokens would hold no useful context, so the slots are
then left off and the pool gets the whole budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIN_SLOT_ROW = 32
"""Fewest positions a decode-slot row is worth having: two 16-token blocks of context. Below it
nearly every request would decode from the pool anyway, and the rows' bytes serve the pool better."""


def slot_bytes(num_rows: int, row_capacity: int, num_layers: int, bytes_per_token: int,
               initial_capacity: int) -> int:
    """Most bytes decode-slot rows of `row_capacity` positions ever hold: every row full, plus the
    one layer's old copy that lives beside the new ones while the rows grow to it (they grow layer
    by layer, doubling from `initial_capacity`; DecodeSlots.ensure_capacity). `bytes_per_token`:
    K and V of every layer."""
    full = num_rows * row_capacity * bytes_per_token
    previous = min(initial_capacity, row_capacity)
    while 2 * previous < row_capacity:  # the last capacity before the full one, on the way there
        previous *= 2
    growing = num_rows * previous * bytes_per_token // num_layers if previous < row_capacity else 0
    return full + growing


@dataclass(frozen=True)
class KVBudget:
    """The split: blocks of the pool, the slots' row capacity (None: no slots) and the bytes of each."""

    num_blocks: int
    slot_row_capacity: int | None
    pool_bytes: int
    slot_bytes: int  # reserved for the rows (slot_bytes()), 0 without slots

    def describe(self, block_size: int, num_rows: int) -> str:
        rows = (f"decode slots reserve {self.slot_bytes / 2**20:.1f} MiB ({num_rows} rows x "
                f"{self.slot_row_capacity} tokens)" if self.slot_row_capacity else "no decode slots")
        return f"KV pool {self.num_blocks} blocks x {block_size} tokens ({self.pool_bytes / 2**20:.1f} MiB), {rows}"


def plan_kv_budget(budget_bytes: int, *, block_size: int, pool_bytes_per_token: int, max_model_len: int,
                   num_slots: int = 0, slot_bytes_per_token: int = 0, num_layers: int = 1,
                   initial_capacity: int = 256, budget_name: str = "kv_cache_memory_gb") -> KVBudget:
    """Split `budget_bytes` (module docstring). `pool_bytes_per_token`: K/V bytes of one token in the
    pool (every layer, the draft model's too); `slot_bytes_per_token`: in a slot row (the target's
    layers). `num_slots` 0: no decode slots. ValueError naming the numbers and the knobs when the
    budget cannot hold one max_model_len request."""
    per_block = block_size * pool_bytes_per_token
    min_blocks = -(-max_model_len // block_size)
    if budget_bytes < min_blocks * per_block:
        slots = (f", before the decode slots (max_num_seqs={num_slots} rows of at least {MIN_SLOT_ROW} tokens x "
                 f"{slot_bytes_per_token} bytes/token)" if num_slots and slot_bytes_per_token else "")
        raise ValueError(
            f"{budget_name}={budget_bytes / 2**30:.4g} ({budget_bytes} bytes) cannot hold one request of "
            f"max_model_len={max_model_len} tokens: the KV pool needs {min_blocks} blocks x {block_size} tokens "
            f"x {pool_bytes_per_token} bytes/token = {min_blocks * per_block} bytes{slots}. "
            f"Raise {budget_name} or lower max_model_len" + (" (and max_num_seqs)" if slots else ""))
    row = None
    reserved = 0
    if num_slots and slot_bytes_per_token:
        def cost(r: int) -> int:  # the rows of the slots and the one spare row (decode_slots.ensure_capacity)
            return slot_bytes(num_slots + 1, r, num_layers, slot_bytes_per_token, initial_capacity)

        def fits(r: int) -> bool:  # the pool keeps one whole request and as many tokens as the rows
            blocks = (budget_bytes - cost(r)) // per_block
            return blocks >= min_blocks and blocks * block_size >= num_slots * r

        lo, hi = 0, max_model_len + 1  # the longest row that fits: fits() only fails more as rows grow
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if lo < MIN_SLOT_ROW:
            log.warning("%s=%.4g leaves decode-slot rows of %d tokens for max_num_seqs=%d, fewer than %d: "
                        "decode slots off (decodes read the paged pool); raise %s or lower max_num_seqs to keep them",
                        budget_name, budget_bytes / 2**30, lo, num_slots, MIN_SLOT_ROW, budget_name)
        else:
            row, reserved = lo, cost(lo)
    num_blocks = (budget_bytes - reserved) // per_block
    return KVBudget(int(num_blocks), row, int(num_blocks * per_block), reserved)
