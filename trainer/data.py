"""The packed-shard loader: global batches in a seeded order, each data-parallel rank reading its own
disjoint slice, with a position that survives restarts and resharding.

The sample stream is the concatenation of epochs; epoch e visits every row of the split once in the
order `permutation(rows, seed=(seed, e))`. Global sample g is row perm_{g // N}[g % N]. Optimizer
step t consumes global samples [t*G, (t+1)*G) for global batch size G; rank r of R takes the
contiguous slice [r*G/R, (r+1)*G/R) of it and cuts that into micro-batches. The state is just the
next global sample index, so a checkpoint taken with R ranks resumes with any R' (issue 7) with
no sample skipped or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .shards import PackedShards


@dataclass
class MicroBatch:
    """inputs = row[:-1], targets = row[1:], both [b, S] int64; `rows` are the global row ids."""

    inputs: torch.Tensor
    targets: torch.Tensor
    rows: np.ndarray


def split_rows(shards: PackedShards, ids: np.ndarray) -> MicroBatch:
    t = torch.from_numpy(np.ascontiguousarray(shards.rows(ids), dtype=np.int64))
    # Separate storage: an objective may mask targets (ignore_index) without touching the inputs.
    return MicroBatch(inputs=t[:, :-1], targets=t[:, 1:].clone(), rows=np.asarray(ids, dtype=np.int64))


class PackedLoader:
    """Iterates optimizer steps; each item is this rank's list of micro-batches for that step."""

    def __init__(
        self,
        split_dir: str | Path,
        *,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ):
        self.shards = PackedShards(split_dir)
        if self.shards.seq_len != seq_len:
            raise ValueError(
                f"{split_dir}: shards hold rows of seq_len={self.shards.seq_len}, the training config asks for "
                f"seq_len={seq_len}; re-run the data stage with this seq_len"
            )
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp = "
                f"{micro_batch_size}*{dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside 0..{dp_size - 1}")
        if len(self.shards) == 0:
            raise ValueError(f"{split_dir}: the split holds no rows")
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.per_rank = global_batch_size // dp_size
        self.next_sample = 0  # global index of the first sample of the next step
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.shards)

    def epoch_order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._perm_epoch = epoch
        return self._perm

    def row_ids(self, start: int, count: int) -> np.ndarray:
        """Row ids of global samples [start, start + count), crossing epoch boundaries as needed."""
        out = np.empty(count, dtype=np.int64)
        for i, g in enumerate(range(start, start + count)):
            epoch, pos = divmod(g, self.num_rows)
            out[i] = self.epoch_order(epoch)[pos]
        return out

    def step_rows(self, step_start: int) -> np.ndarray:
        """This rank's row ids of the global batch starting at global sample `step_start`."""
        return self.row_ids(step_start + self.dp_rank * self.per_rank, self.per_rank)

    def next_step(self) -> list[MicroBatch]:
        ids = self.step_rows(self.next_sample)
        self.next_sample += self.global_batch_size
        b = self.micro_batch_size
        return [split_rows(self.shards, ids[i : i + b]) for i in range(0, len(ids), b)]

    def __iter__(self):
        while True:
            yield self.next_step()

    @property
    def epoch(self) -> float:
        return self.next_sample / self.num_rows

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample, "seed": self.seed, "rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        if state["rows"] != self.num_rows or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for {state['rows']} rows with seed {state['seed']}, this split has "
                f"{self.num_rows} rows with seed {self.seed}: it belongs to different data"
            )
        if state["next_sample"] % self.global_batch_size:
            raise ValueError(
                f"loader state next_sample={state['next_sample']} is not on a global batch boundary "
                f"(global_batch_size={self.global_batch_size})"
            )
        self.next_sample = int(state["next_sample"])


def validation_batches(
    split_dir: str | Path, *, seq_len: int, batch_size: int, max_batches: int, dp_rank: int = 0, dp_size: int = 1
) -> list[MicroBatch]:
    """The first max_batches * batch_size * dp_size rows in file order (fixed, so every evaluation sees
    the same tokens), dealt round-robin by batch to the ranks. Fewer when the split is smaller."""
    shards = PackedShards(split_dir)
    if shards.seq_len != seq_len:
        raise ValueError(f"{split_dir}: validation rows have seq_len={shards.seq_len}, expected {seq_len}")
    n = min(len(shards), max_batches * batch_size * dp_size)
    batches = []
    for i, start in enumerate(range(0, n, batch_size)):
        if i % dp_size == dp_rank:
            ids = np.arange(start, min(start + batch_size, n))
            batches.append(split_rows(shards, ids))
    return batches
