"""Train/validation split by document hash: the same text always lands in the same split, whatever else is
in the corpus, so a document (or an exact duplicate of it) never straddles both."""

from __future__ import annotations

import numpy as np


def hash_fraction(doc_hash: str) -> float:
    """A document's position in [0, 1) from the first 64 bits of its hex hash."""
    return int(doc_hash[:16], 16) / 2.0**64


def assign_validation(doc_hashes: list[str], val_fraction: float, groups: list[str] | None = None) -> np.ndarray:
    """Boolean mask of validation documents: hash fraction below val_fraction.

    Two corrections keep small corpora usable, both still decided by hash alone: every group (source) keeps its
    highest-fraction document in train, so its mixture weight can be honoured; and if nothing falls below
    val_fraction, the lowest-fraction document of a group with another training document goes to validation."""
    frac = np.array([hash_fraction(h) for h in doc_hashes], dtype=np.float64)
    val = frac < val_fraction
    groups = groups if groups is not None else [""] * len(frac)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        if val[idx].all():
            val[max(idx, key=lambda i: frac[i])] = False
    if not val.any():
        movable = [i for idx in members.values() if len(idx) >= 2 for i in idx]
        if movable:
            val[min(movable, key=lambda i: frac[i])] = True
    return val
