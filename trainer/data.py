"""The packed-shard loader: global batches in a seeded order, each data-parallel rank reading its own
disjoint slice, with a position that survives restarts and resharding.

The sample stream is the concatenation of epochs; epoch e visits every row of the split once in the
order `permutation(rows, seed=(seed, e))`. Global sample g is row perm_{g // N}[g % N]. Optimizer
step t consumes global samples [t*G, (t+1)*G) for global batch size G; rank r of R takes the
contiguous slice [r*G/R, (r+1)*G/R) of it and cuts that into micro-batches. The state is just the
next global sample index, so a checkpoint taken with R ranks resumes with any R' (issue 7) with
no sample skipped or repeated.

With a data mixture (`pretrain.data_mixture`, chosen by the ablations) the split's index must say which
rows hold which source (`"sources": [{"name", "start", "end"}]`, contiguous row ranges written by the
tokens stage). Global sample g is then drawn by `MixtureOrder`: the stream is cut into chunks of B
samples; the number of samples of each source among the first n = c*B is the largest-remainder rounding
of w_s * n (exact integer arithmetic), so every chunk holds each source's share to within one sample
and the counts before any chunk are known in closed form; inside a chunk the sources are placed in a
seeded permutation; the k-th sample of source s is row perm_s,e[k mod n_s] of that source's own seeded
epochs (e = k // n_s). Everything is a function of g, so resuming and resharding work as without a
mixture. Splits written before the index had `sources` load as before (rows uniformly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from .shards import PackedShards


@dataclass
class MicroBatch:
    """inputs = row[:-1], targets = row[1:], both [b, S] int64; `rows` are the global row ids; `documents`
    [b, S], when set, are the inputs' document ids in rows packed from several documents (the model then
    masks attention and restarts positions per document)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    rows: np.ndarray
    documents: torch.Tensor | None = None


def split_rows(shards: PackedShards, ids: np.ndarray) -> MicroBatch:
    t = torch.from_numpy(np.ascontiguousarray(shards.rows(ids), dtype=np.int64))
    # Separate storage: an objective may mask targets (ignore_index) without touching the inputs.
    return MicroBatch(inputs=t[:, :-1], targets=t[:, 1:].clone(), rows=np.asarray(ids, dtype=np.int64))


def source_ranges(shards: PackedShards) -> dict[str, tuple[int, int]] | None:
    """name -> [start, end) rows of each source, from the split's index; None when it does not say."""
    entries = shards.index.get("sources")
    if not entries:
        return None
    ranges = {e["name"]: (int(e["start"]), int(e["end"])) for e in entries}
    spans = sorted(ranges.values())
    if spans[0][0] != 0 or spans[-1][1] != len(shards) or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"{shards.dir}: index.json `sources` {entries} do not tile the {len(shards)} rows")
    return ranges


def _exact_weights(weights: dict[str, float]) -> dict[str, int]:
    """Positive weights as integers with the same ratios (exact, so chunk counts never drift)."""
    fr = {k: Fraction(float(v)) for k, v in weights.items()}
    den = math.lcm(*(f.denominator for f in fr.values()))
    ints = {k: int(f * den) for k, f in fr.items()}
    common = math.gcd(*ints.values())
    return {k: v // common for k, v in ints.items()}


class MixtureOrder:
    """Global sample index -> row id, with each source's share of samples set by `weights`."""

    def __init__(self, ranges: dict[str, tuple[int, int]], weights: dict[str, float], seed: int, where: str = ""):
        unknown = sorted(set(weights) - set(ranges))
        if unknown:
            raise ValueError(f"data mixture names source(s) {unknown} that {where or 'the split'} does not hold "
                             f"(it holds {sorted(ranges)})")
        bad = {k: v for k, v in weights.items() if not v >= 0}
        if bad:
            raise ValueError(f"data mixture weights must be >= 0, got {bad}")
        self.names = [k for k in sorted(weights) if weights[k] > 0]
        if not self.names:
            raise ValueError(f"data mixture {weights} gives every source weight 0")
        empty = [k for k in self.names if ranges[k][1] <= ranges[k][0]]
        if empty:
            raise ValueError(f"data mixture gives weight to source(s) {empty} with no rows in {where or 'the split'}")
        self.seed = seed
        ints = _exact_weights({k: weights[k] for k in self.names})
        self.w = [ints[k] for k in self.names]
        self.w_sum = sum(self.w)
        self.start = np.array([ranges[k][0] for k in self.names], dtype=np.int64)
        self.size = np.array([ranges[k][1] - ranges[k][0] for k in self.names], dtype=np.int64)
        # B >= W / w_min puts every source in every chunk at least once, which keeps the cumulative
        # counts monotone in the chunk index.
        self.chunk = max(1024, -(-self.w_sum // min(self.w)))
        if self.chunk > 1 << 20:
            raise ValueError(f"data mixture {weights}: a share below 1e-6 of the samples (chunks would exceed 2^20 "
                             "samples); drop that source (weight 0) instead")
        self.shares = {k: w / self.w_sum for k, w in zip(self.names, self.w)}
        self._chunk_id: int | None = None
        self._chunk: tuple[np.ndarray, np.ndarray] | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def cumulative(self, chunk: int) -> np.ndarray:
        """Samples of each source among the first chunk * B (largest remainder of w_s * n / W)."""
        n = chunk * self.chunk
        q = [w * n // self.w_sum for w in self.w]
        rem = [w * n % self.w_sum for w in self.w]
        short = n - sum(q)
        for i in sorted(range(len(q)), key=lambda i: (-rem[i], i))[:short]:
            q[i] += 1
        return np.array(q, dtype=np.int64)

    def _chunk_layout(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each sample in chunk c, its index among that source's samples since the start)."""
        if self._chunk_id != c:
            before, after = self.cumulative(c), self.cumulative(c + 1)
            counts = after - before
            labels = np.random.default_rng([self.seed, 0x6D6978, c]).permutation(np.repeat(np.arange(len(counts)), counts))
            k = np.empty(self.chunk, dtype=np.int64)
            for s in range(len(counts)):
                at = np.flatnonzero(labels == s)
                k[at] = before[s] + np.arange(at.size)
            self._chunk_id, self._chunk = c, (labels, k)
        return self._chunk

    def _source_perm(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.names):
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, s, epoch]).permutation(int(self.size[s]))
        return self._perms[key]

    def source_of(self, g: int) -> str:
        c, pos = divmod(g, self.chunk)
        return self.names[int(self._chunk_layout(c)[0][pos])]

    def row(self, g: int) -> int:
        c, pos = divmod(g, self.chunk)
        labels, k = self._chunk_layout(c)
        s, kk = int(labels[pos]), int(k[pos])
        epoch, i = divmod(kk, int(self.size[s]))
        return int(self.start[s] + self._source_perm(s, epoch)[i])


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
        mixture: dict[str, float] | None = None,
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
        self.mixture: MixtureOrder | None = None
        if mixture is not None:
            ranges = source_ranges(self.shards)
            if ranges is None:
                raise ValueError(
                    f"{split_dir}: a data mixture {mixture} was asked for, but this split's index.json has no "
                    "`sources` (packed before per-source rows were recorded); re-run the tokens stage"
                )
            self.mixture = MixtureOrder(ranges, mixture, seed, str(split_dir))

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
        if self.mixture is not None:
            for i, g in enumerate(range(start, start + count)):
                out[i] = self.mixture.row(g)
            return out
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
        state = {"next_sample": self.next_sample, "seed": self.seed, "rows": self.num_rows}
        if self.mixture is not None:
            state["mixture"] = dict(self.mixture.shares)
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["rows"] != self.num_rows or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for {state['rows']} rows with seed {state['seed']}, this split has "
                f"{self.num_rows} rows with seed {self.seed}: it belongs to different data"
            )
        mine = dict(self.mixture.shares) if self.mixture is not None else None
        theirs = state.get("mixture")
        if (mine is None) != (theirs is None) or (mine is not None and (
                set(mine) != set(theirs) or any(abs(mine[k] - theirs[k]) > 1e-12 for k in mine))):
            raise ValueError(f"loader state was written with data mixture {theirs}, this loader samples {mine}: "
                             "resuming would change the data order")
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
