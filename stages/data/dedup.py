"""Exact and near-duplicate detection, on datatrove's dedup stages.

Exact: a hash of the text after light normalisation (case-folded, whitespace collapsed), found across all
shards by datatrove's ExactDedupSignature and ExactFindDedups. Near: datatrove's MinHash stages
(MinhashDedupSignature, MinhashDedupBuckets, MinhashDedupFilter) over word n-gram shingles, with the b bands of
r rows chosen to minimise the false positive + false negative mass around the Jaccard threshold, as datasketch
does (Leskovec et al., Mining of Massive Datasets, ch. 3). datatrove confirms no candidate pair against the
signatures, so the fit weighs both errors evenly.

The clustering stage is ours (`FirstKeptCluster`): datatrove's MinhashDedupCluster keeps the root of a union
by size, which can be any document of a cluster; this one keeps the first in corpus order (shard, then
position), as the stage always did, and it merges in the exact duplicates so the two dedups agree: of an
exact group inside a near-duplicate cluster, the one document kept by both is the one kept.
"""

from __future__ import annotations

import hashlib
import re
import struct

import numpy as np
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.typeshelper import ExtensionHelperSD
from xxhash import xxh64_intdigest as _xxh64_intdigest

_SPACE = re.compile(r"\s+")


def exact_key(doc) -> bytes:
    """What exact dedup hashes: the text case-folded with whitespace collapsed, as UTF-8."""
    return _SPACE.sub(" ", doc.text.casefold()).strip().encode("utf-8", "surrogatepass")


# ExactDedupSignature picks its hash function's input type from this annotation (a string under postponed
# evaluation of annotations, which it would take for str); xxhash takes bytes only.
exact_key.__annotations__["return"] = bytes


def shard_priority(doc) -> int:
    """Exact dedup keeps the highest priority, then the lowest position in a shard, in any shard: earlier shards
    get higher priorities so the first copy in corpus order stays (the first 65,534 shards apart; beyond, ties)."""
    return max(1, 65535 - doc.metadata.get("shard", 0))


def xxh64_text(text: str) -> int:
    """MinHash shingle hash: datatrove's xxhash64 hands str to an xxhash that takes bytes only. Called once
    per shingle (600k times on the tiny corpus): the hash is bound at import, not looked up per call."""
    return _xxh64_intdigest(text.encode("utf-8", "surrogatepass"))


def normalized_hash(text: str) -> str:
    """The document's identity for exact dedup and the train/validation split."""
    canon = _SPACE.sub(" ", text.casefold()).strip()
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


def lsh_params(threshold: float, num_perm: int, fp_weight: float = 0.5, fn_weight: float = 0.5) -> tuple[int, int]:
    """(bands, rows) minimising weighted false-positive and false-negative probability mass (datasketch's rule)."""
    lo, hi = np.linspace(0.0, threshold, 1001), np.linspace(threshold, 1.0, 1001)
    best, best_cost = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = np.trapezoid(1.0 - (1.0 - lo**r) ** b, lo)  # P(candidate) below the threshold
            fn = np.trapezoid((1.0 - hi**r) ** b, hi)  # P(missed) above it
            cost = fp_weight * fp + fn_weight * fn
            if cost < best_cost:
                best, best_cost = (b, r), cost
    return best


def _read_u32(folder, name: str, fmt: str = "<u4") -> np.ndarray:
    with folder.open(name, "rb") as f:
        return np.frombuffer(f.read(), dtype=fmt)


class FirstKeptCluster(PipelineStep):
    """Stage 3 of the dedup (one task): near-duplicate pairs from MinhashDedupBuckets' `.dups` files and exact
    duplicates from ExactFindDedups become clusters; every document but the first of each is listed in
    `{shard:06d}.remove` (what datatrove's MinhashDedupFilter reads), the exact ones also in `.exact`."""

    type = "🫂 - DEDUP"
    name = "🎯 clusters (first kept)"

    def __init__(self, pairs_folder: str | None, exact_folder: str | None, output_folder: str):
        super().__init__()
        self.pairs_folder, self.exact_folder, self.output_folder = pairs_folder, exact_folder, output_folder

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        parent: dict[tuple[int, int], tuple[int, int]] = {}

        def find(x):
            root = x
            while parent.get(root, root) != root:
                root = parent[root]
            while x != root:  # path compression
                parent[x], x = root, parent[x]
            return root

        with self.track_time():
            if self.pairs_folder:
                folder = get_datafolder(self.pairs_folder)
                for name in folder.list_files(glob_pattern="*.dups"):
                    pairs = _read_u32(folder, name).reshape(-1, 4)
                    for f1, d1, f2, d2 in pairs.tolist():
                        a, b = find((f1, d1)), find((f2, d2))
                        if a != b:
                            lo, hi = min(a, b), max(a, b)
                            parent[hi] = lo  # the root is the cluster's first document
                            parent.setdefault(lo, lo)
            exact: set[tuple[int, int]] = set()
            if self.exact_folder:
                folder = get_datafolder(self.exact_folder)
                names = [n for n in folder.list_files() if n.endswith(ExtensionHelperSD.stage_2_duplicates)]
                for name in names:
                    shard = int(name.rsplit("/", 1)[-1].removesuffix(ExtensionHelperSD.stage_2_duplicates))
                    exact.update((shard, int(d)) for d in _read_u32(folder, name).tolist())
            # A cluster keeps its first document that exact dedup keeps.
            keeper: dict[tuple[int, int], tuple[int, int]] = {}
            for node in sorted(parent):
                root = find(node)
                if node not in exact and root not in keeper:
                    keeper[root] = node
            remove: dict[int, set[int]] = {}
            for node in parent:
                if node not in exact and keeper.get(find(node)) != node:
                    remove.setdefault(node[0], set()).add(node[1])
                    self.stat_update("near_duplicates")
            for shard, doc in exact:
                remove.setdefault(shard, set()).add(doc)
                self.stat_update("exact_duplicates")
            out = get_datafolder(self.output_folder)
            for shard, docs in remove.items():
                with out.open(f"{shard:06d}.remove", "wb") as f:
                    f.write(struct.pack(f"<{len(docs)}I", *sorted(docs)))
                ex = sorted(d for s, d in exact if s == shard)
                if ex:
                    with out.open(f"{shard:06d}.exact", "wb") as f:
                        f.write(struct.pack(f"<{len(ex)}I", *ex))
        return
        yield
