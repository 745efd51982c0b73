"""Which link each parallel dimension's collectives cross, and how long its bytes take on it.

The mesh is the trainer's (trainer/parallel/mesh.py): ranks ordered dp_replicate, dp_shard, pp, cp, tp,
tp innermost, so rank = ((((rep * shard + sh) * pp + s) * cp + c) * tp + t); node = rank // nproc_per_node.
Expert parallelism cuts each dp x cp group (cp fastest) into consecutive blocks of ep ranks
(trainer/parallel/mesh.expert_mesh). A group whose members sit on one node talks over NVLink
("about 450 GB/s each way per H100"); one that spans nodes is limited by the network ("about 50 GB/s per
GPU on 400 Gb/s InfiniBand"): a ring runs at the speed of its slowest hop.
"""

from __future__ import annotations

import numpy as np

from .schedule import bubble_fraction


def mesh_shape(par) -> dict[str, int]:
    """Sizes of the mesh's axes as the trainer builds them (ZeRO 0/1 replicate over all of dp)."""
    return {"dp_replicate": par.dp // par.dp_shard, "dp_shard": par.dp_shard, "pp": par.pp, "cp": par.cp, "tp": par.tp}


def mesh_groups(par) -> dict[str, np.ndarray]:
    """Every process group of every dimension: an array with one row of global ranks (ascending) per group."""
    shape = mesh_shape(par)
    axes = list(shape)
    grid = np.arange(par.world_size).reshape([shape[a] for a in axes])

    def groups(varying: list[str]) -> np.ndarray:
        idx = [axes.index(a) for a in varying]
        other = [i for i in range(len(axes)) if i not in idx]
        return grid.transpose(*other, *idx).reshape(-1, int(np.prod([shape[a] for a in varying])))

    data = groups(["dp_replicate", "dp_shard", "cp"])  # the ranks that hold the same dense weights
    return {"dp": groups(["dp_replicate", "dp_shard"]), "dp_replicate": groups(["dp_replicate"]),
            "dp_shard": groups(["dp_shard"]), "dp_cp": data, "pp": groups(["pp"]), "cp": groups(["cp"]),
            "tp": groups(["tp"]), "ep": data.reshape(-1, par.ep)}


def group_links(par) -> dict[str, dict]:
    """For each dimension: its size, the most nodes one of its groups spans, and the link it runs on."""
    out = {}
    for dim, gs in mesh_groups(par).items():
        nodes = gs // par.nproc_per_node
        spanned = int((1 + (np.diff(nodes, axis=1) != 0).sum(axis=1)).max())  # rows ascend: count node changes
        out[dim] = {"size": int(gs.shape[1]), "nodes_spanned": spanned, "link": "network" if spanned > 1 else "nvlink"}
    return out


def link_time(nbytes: float, link: str, intra_bandwidth: float, inter_bandwidth: float) -> float:
    """Seconds to send `nbytes` from one GPU over `link` ("nvlink" or "network"): bandwidth only, no latency."""
    if link not in ("nvlink", "network"):
        raise ValueError(f"link must be nvlink or network, got {link!r}")
    return nbytes / (intra_bandwidth if link == "nvlink" else inter_bandwidth)


def placement_warnings(par, links: dict[str, dict]) -> list[str]:
    """The seed's placement rules the layout breaks: TP stays inside a node on NVLink; context and
    expert parallelism come next, also inside a node where possible."""
    out = []
    nproc = par.nproc_per_node
    if links["tp"]["link"] == "network":
        out.append(f"tensor parallelism crosses nodes: tp={par.tp} > nproc_per_node={nproc} (or misaligned); its "
                   f"all-reduces sit on the critical path of every layer (seed: TP stays inside a node on NVLink, "
                   f"~450 GB/s, and almost never crosses the network, ~50 GB/s per GPU)")
    if par.cp > 1 and links["cp"]["link"] == "network":
        out.append(f"context parallelism crosses nodes: tp x cp = {par.tp} x {par.cp} = {par.tp * par.cp} > "
                   f"nproc_per_node={nproc} (seed: context and expert parallelism come next after TP, on NVLink)")
    if par.ep > 1 and links["ep"]["link"] == "network":
        out.append(f"expert parallelism crosses nodes: its ep={par.ep} groups span {links['ep']['nodes_spanned']} nodes "
                   f"(seed: the all-to-alls are latency-sensitive, so teams keep EP inside a node where possible)")
    return out


def pipeline_warning(schedule: str, p: int, m: int) -> str | None:
    """The seed's rule of thumb for plain 1F1B: keep m at 4p or more (the bubble is (p-1)/(m+p-1))."""
    if schedule != "1f1b" or p < 2 or m >= 4 * p:
        return None
    bubble = bubble_fraction(p, m)
    text = (f"1F1B with m={m} micro-batches on p={p} stages: the bubble is {bubble:.0%} of the step; the seed's rule "
            f"of thumb keeps m at 4p={4 * p} or more (raise the global batch or lower the micro-batch size)")
    if m == 4 and p == 2:
        text += "; this is the seed's own example ('In our step m = 4 and p = 2, so the bubble is 20%')"
    return text
