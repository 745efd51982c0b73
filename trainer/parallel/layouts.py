"""Which combinations of the parallel techniques this trainer composes, refused with the reason
before any group is built (the config validates sizes; this validates what is implemented)."""

from __future__ import annotations

from infra.config.parallel import ParallelConfig


def check_supported(parallel: ParallelConfig) -> None:
    p = parallel
    others = {"pp": p.pp, "cp": p.cp, "ep": p.ep}
    if p.zero > 0 and any(v > 1 for v in others.values()):
        raise NotImplementedError(
            f"zero={p.zero} with pp={p.pp} cp={p.cp} ep={p.ep}: ZeRO/FSDP compose with tensor parallel only "
            f"here; pipeline, context and expert parallel use DDP (zero=0)"
        )
    if p.tp > 1 and (p.cp > 1 or p.ep > 1):
        raise NotImplementedError(f"tp={p.tp} with cp={p.cp} ep={p.ep} is not composed yet")
    # tp x pp (x dp) composes: the pipeline step averages data-parallel gradients itself, DTensors included.
    if p.tp > 1 and p.zero == 0 and p.dp > 1 and p.pp == 1:
        raise NotImplementedError(
            f"tp={p.tp} with dp={p.dp} needs zero 1, 2 or 3 (DDP does not take tensor-parallel DTensors)"
        )
