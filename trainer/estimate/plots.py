"""Pictures of an estimate (PNG, matplotlib without a display): the memory of each pipeline stage's GPU
with the busiest marked, the device mesh (which rank holds which coordinates and layers), the
pipeline schedules as timelines with the bubble visible, and serving throughput and TPOT by concurrency."""

from __future__ import annotations

from pathlib import Path

from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from infra.config.schema import LifecycleConfig

from .schedule import bubble_fraction, play
from .serving import serve_model

GB = 1e9
PARTS = [("weights", "#4c72b0"), ("grads", "#55a868"), ("optimizer", "#8172b2"), ("activations", "#dd8452"),
         ("recompute_working", "#f2c45a"), ("logits", "#c44e52")]


def _layer_label(layers: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> 'L0-2, L5-6' (layers counted from 0, as the checkpoint names them)."""
    if not layers:
        return "no layers"
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"L{start}" if start == a else f"L{start}-{a}")
            start = b
    return ", ".join(runs)


def _stage_label(stage: dict) -> str:
    parts = (["emb"] if stage["holds_embedding"] else []) + [_layer_label(stage["layers"])] + (
        ["head"] if stage["holds_head"] else [])
    return " + ".join(parts)


def plot_memory(est: dict, path: Path) -> Path:
    """Stacked bars of one GPU's memory on each pipeline stage, the GPU's capacity as a line."""
    stages = est["stages"]
    fig = Figure(figsize=(min(14.0, max(6.5, 0.75 * len(stages) + 3)), 6.0), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(stages))
    bottom = [0.0] * len(stages)
    for name, color in PARTS:
        vals = [st["bytes"][name] / GB for st in stages]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=color, label=name.replace("_", " "), width=0.7)
            bottom = [b + v for b, v in zip(bottom, vals)]
    cap = est["gpu_memory_bytes"] / GB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(-0.4, cap, f"GPU memory {cap:.0f} GB", va="bottom", ha="left", fontsize=9)
    busiest = est["busiest_pp_rank"]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8,
                fontweight="bold" if i == busiest else "normal")
    ax.set_xticks(list(xs), [f"pp {st['pp_rank']}\n{_stage_label(st)}" for st in stages],
                  fontsize=8 if len(stages) <= 8 else 6, rotation=0 if len(stages) <= 8 else 60)
    ax.get_xticklabels()[busiest].set_color("#c44e52")
    ax.set_ylabel("GB per GPU")
    ax.set_ylim(0, max(max(bottom), cap) * 1.15)
    ax.set_title(
        f"{est['config']}: memory of one GPU per pipeline stage (busiest: pp {busiest}, "
        f"{est['busiest_rank_bytes'] / GB:.1f} GB)\nZeRO-{est['zero']}, recompute {est['activation_recompute']}, "
        f"FlashAttention {'on' if est['flash_attention'] else 'off'}, {est['micro_batches']} micro-batches",
        fontsize=10)
    ax.legend(loc="upper right", fontsize=8, ncols=3)
    fig.savefig(path, dpi=110)
    return path


def plot_mesh(cfg: LifecycleConfig, est: dict, path: Path, max_replicas: int = 4) -> Path:
    """Every rank as a box placed by its (dp, pp, cp x tp) coordinates, labelled with its rank and node;
    each pipeline row says which layers it holds. Large meshes show their first replicas."""
    par = cfg.parallel
    dp, pp, cp, tp = par.dp, par.pp, par.cp, par.tp
    inner = cp * tp
    shown = min(dp, max_replicas if pp * inner <= 64 else 2)
    stages = est["stages"]
    colors = ["#c6dbef", "#c7e9c0", "#fdd0a2", "#dadaeb", "#fcbba1", "#d9d9d9"]
    box_w, box_h, gap = 1.0, 0.8, 0.6
    width = shown * inner * box_w + (shown - 1) * gap
    fig = Figure(figsize=(min(4 + width * 1.1, 22), min(1.6 + pp * 0.75, 20)), layout="constrained")
    ax = fig.add_subplot()
    small = shown * inner * pp > 96
    for d in range(shown):
        x0 = d * (inner * box_w + gap)
        ax.text(x0 + inner * box_w / 2, -0.35, f"dp {d}", ha="center", fontsize=9, fontweight="bold")
        for s in range(pp):
            for c in range(cp):
                for t in range(tp):
                    rank = ((d * pp + s) * cp + c) * tp + t
                    x = x0 + (c * tp + t) * box_w
                    ax.add_patch(Rectangle((x + 0.04, s + 0.1), box_w - 0.08, box_h, facecolor=colors[s % len(colors)],
                                           edgecolor="black", linewidth=0.6))
                    if small:
                        label = f"{rank}"
                    else:
                        label = f"rank {rank}\nnode {rank // par.nproc_per_node}\ntp {t}" + (f" cp {c}" if cp > 1 else "")
                    ax.text(x + box_w / 2, s + 0.1 + box_h / 2, label, ha="center", va="center",
                            fontsize=5 if small else 7)
    for s in range(pp):
        ax.text(-0.15, s + 0.5, f"pp {s}: {_stage_label(stages[s])}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.2 - 0.12 * max(len(_stage_label(st)) for st in stages), width + 0.2)
    ax.set_ylim(pp + 0.1, -0.7)
    ax.axis("off")
    more = f" (showing {shown} of {dp} data-parallel replicas)" if shown < dp else ""
    ax.set_title(
        f"{est['config']}: device mesh dp={dp} x pp={pp} x cp={cp} x tp={tp} = {par.world_size} ranks, "
        f"{par.nproc_per_node} per node{more}\nrank = ((dp*pp + pp_rank)*cp + cp_rank)*tp + tp_rank; "
        f"tp innermost (NVLink), dp outermost", fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def _lighter(color: str, amount: float = 0.55) -> tuple[float, float, float]:
    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def plot_schedules(p: int, m: int, v: int, path: Path, title: str = "") -> Path:
    """GPipe, 1F1B and interleaved 1F1B timelines for p stages and m micro-batches on one time axis.
    Forward passes light, backward dark, idle time hatched red: its share is the bubble."""
    v = max(v, 2)
    panels = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", v)]
    fig = Figure(figsize=(13, 1.2 + 3 * (0.45 * p + 0.8)), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    longest = 3.0 * (m + p - 1)
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c"]
    for ax, (schedule, vv) in zip(axes, panels):
        label = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": f"interleaved 1F1B (v={vv} chunks per GPU)"}[schedule]
        if schedule == "interleaved_1f1b" and m % p:
            ax.text(0.5, 0.5, f"{label}: needs m divisible by p (m={m}, p={p})", transform=ax.transAxes, ha="center")
            ax.axis("off")
            continue
        tl = play(schedule, p, m, vv)
        for r in range(p):
            ax.add_patch(Rectangle((0, r + 0.08), tl.makespan, 0.84, facecolor="#fbe3e3", edgecolor="none",
                                   hatch="///", alpha=0.9))
        for x in tl.passes:
            base = palette[x.micro_batch % len(palette)]
            face = base if x.kind == "B" else _lighter(base)  # forward: the same hue, paler
            ax.add_patch(Rectangle((x.start, x.rank + 0.08), x.end - x.start, 0.84, facecolor=face,
                                   edgecolor="white", linewidth=0.5))
            if (x.end - x.start) * 13 / longest > 0.18:  # label only passes wide enough to read
                text = f"{'F' if x.kind == 'F' else 'B'}{x.micro_batch}" + (f".{x.chunk // p}" if vv > 1 else "")
                ax.text((x.start + x.end) / 2, x.rank + 0.5, text, ha="center", va="center", fontsize=6,
                        color="black" if x.kind == "F" else "white")
        formula = bubble_fraction(p, m, vv)
        ax.set_title(f"{label}: bubble {tl.bubble_fraction:.1%} of the step measured on the timeline, "
                     f"formula (p-1)/({'v*' if vv > 1 else ''}m+p-1) = {formula:.1%}", fontsize=9, loc="left")
        ax.set_ylim(p, 0)
        ax.set_yticks([r + 0.5 for r in range(p)], [f"GPU {r}" for r in range(p)], fontsize=7)
        ax.set_xlim(0, longest)
    axes[-1].set_xlabel("time (one micro-batch: forward 1, backward 2 units through the whole model)")
    handles = [Patch(facecolor=_lighter(palette[0]), label="forward F<micro-batch>[.<chunk>]"),
               Patch(facecolor=palette[0], label="backward"),
               Patch(facecolor="#fbe3e3", hatch="///", label="idle (bubble)")]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
    fig.suptitle(title or f"Pipeline schedules, p={p} stages, m={m} micro-batches", fontsize=11, x=0.01, ha="left")
    fig.savefig(path, dpi=110)
    return path


def plot_serving(cfg: LifecycleConfig, est: dict, path: Path) -> Path:
    """Aggregate decode throughput and TPOT against concurrency (log scale) up to the KV-cache limit, with
    the linear extrapolation from one sequence (seed: "throughput climbs almost linearly with concurrency")
    and the knee and the KV limit marked."""
    sv = est["serve"]
    sm = serve_model(cfg)
    limit, knee = sv["max_concurrency"], sv["knee_concurrency"]
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_tps, ax_tpot = fig.subplots(1, 2)
    title = (f"{est['config']}: decode on {sv['tp']} GPU{'s' if sv['tp'] > 1 else ''} per replica, {sv['weight_dtype']} "
             f"weights, {sv['kv_dtype']} KV, {sv['prompt_len']} + {sv['output_len']} tokens; "
             f"TTFT {sv['ttft_s'] * 1e3:.2f} ms")
    if limit < 1:
        for ax in (ax_tps, ax_tpot):
            ax.text(0.5, 0.5, "the weights leave no room for a KV cache", transform=ax.transAxes, ha="center")
            ax.axis("off")
        fig.suptitle(title, fontsize=10)
        fig.savefig(path, dpi=110)
        return path
    xs = sorted({max(1, round(limit ** (i / 80))) for i in range(81)} | {limit})
    rows = [sm.decode_step(b, sv["average_context"]) for b in xs]
    tps = [r["tokens_per_s"] for r in rows]
    tpot = [r["tpot_s"] * 1e3 for r in rows]
    colors = {"weights": "#4c72b0", "kv_reads": "#dd8452", "compute": "#c44e52"}
    labels = {"weights": "weight-read-bound", "kv_reads": "KV-read-bound", "compute": "compute-bound"}
    for ax, ys in ((ax_tps, tps), (ax_tpot, tpot)):
        ax.plot(xs, ys, color="black", linewidth=1)
        for bound, color in colors.items():
            pts = [(x, y) for x, y, r in zip(xs, ys, rows) if r["bound"] == bound]
            if pts:
                ax.scatter(*zip(*pts), s=10, color=color, label=labels[bound], zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sequences")
        ax.axvline(limit, color="black", linestyle="--", linewidth=1)
        ax.text(limit, 0.98, f" KV limit {limit:,}", transform=ax.get_xaxis_transform(), ha="right", va="top", fontsize=8)
        if knee and knee < limit:
            ax.axvline(knee, color="#8172b2", linestyle=":", linewidth=1.2)
            ax.text(knee, 0.55, f" knee {knee:,}\n ({sv['knee_reason'].replace('_', ' ')})",
                    transform=ax.get_xaxis_transform(), fontsize=8, color="#8172b2")
    ax_tps.plot(xs, [tps[0] * x for x in xs], color="gray", linestyle="--", linewidth=0.8,
                label="linear from 1 sequence")
    ax_tps.set_ylim(0, max(tps) * 1.25)
    ax_tps.set_ylabel("output tokens/s (all sequences)")
    ax_tps.set_title("aggregate throughput", fontsize=10)
    ax_tps.legend(fontsize=8, loc="upper left")
    ax_tpot.set_ylim(0, max(tpot) * 1.15)
    ax_tpot.set_ylabel("TPOT, ms (one decode step)")
    ax_tpot.set_title("time per output token", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def write_plots(cfg: LifecycleConfig, est: dict, out_dir: str | Path) -> list[Path]:
    """All four pictures into `out_dir` (created): memory.png, mesh.png, pipeline.png, serving.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p, m, v = cfg.parallel.pp, est["micro_batches"], cfg.parallel.pp_virtual_stages
    title = f"{cfg.name}: pipeline schedules for p={p} stages, m={m} micro-batches"
    if p == 1:
        title += " (no pipeline in this layout: one GPU, no bubble)"
    return [plot_memory(est, out / "memory.png"), plot_mesh(cfg, est, out / "mesh.png"),
            plot_schedules(p, m, v, out / "pipeline.png", title), plot_serving(cfg, est, out / "serving.png")]
