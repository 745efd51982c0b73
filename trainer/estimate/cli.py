"""`eightfold estimate [CONFIG | --preset NAME] [--set ...] [--json] [--plot DIR]`: a readable summary
(rich) by default, one JSON object with stable keys for scripts, and PNGs on request."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from infra.config.load import ConfigError, load_config

from .presets import load_preset
from .run import estimate_run

console = Console(stderr=False, soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)


def fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def fmt_bytes(n: float) -> str:
    """Decimal units as the seed writes them (20.4 GB, 1.13 TB); MiB for collective buffers below 1 GB."""
    if n == 0:
        return "-"
    if abs(n) >= 1e12:
        return f"{n / 1e12:.2f} TB"
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def fmt_flops(n: float) -> str:
    for unit, div in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.3g} FLOP"


def _table(title: str, rows: list[tuple[str, str, str]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    for row in rows:
        t.add_row(*row)
    return t


def print_summary(est: dict) -> None:
    b = est["busiest_rank_breakdown"]
    per_param = est["state_bytes_per_param_breakdown"]
    console.print(f"[bold]{est['config']}[/bold]: {est['gpus']} GPUs at {est['gpu_peak_flops'] / 1e12:.0f} TFLOP/s "
                  f"peak, {est['mfu']:.0%} MFU")
    console.print(_table("Model", [
        ("parameters", fmt_count(est["params"]), f"active per token {fmt_count(est['active_params'])}"),
        ("model state", fmt_bytes(est["state_bytes"]),
         f"{est['state_bytes_per_param']} bytes/param = {per_param['weights']} weight + {per_param['grads']} grad + "
         f"{per_param['optimizer']} optimizer"),
        ("KV cache per token", fmt_bytes(est["kv_bytes_per_token"]), "2 x layers x KV heads x head size x 2 bytes"),
    ]))
    by_zero = ", ".join(f"ZeRO-{z} {fmt_bytes(v)}" for z, v in est["state_bytes_per_rank_by_zero"].items())
    modes = est["activation_bytes_per_layer_by_mode"]
    console.print(_table(f"Busiest GPU (pipeline stage {est['busiest_pp_rank']})", [
        ("total", fmt_bytes(est["busiest_rank_bytes"]),
         f"of {fmt_bytes(est['gpu_memory_bytes'])}: " + ("fits" if est["fits"] else "[red]does not fit[/red]")),
        ("model state", fmt_bytes(est["state_bytes_per_rank"]), by_zero),
        ("  weights / grads / optimizer", f"{fmt_bytes(b['weights'])} / {fmt_bytes(b['grads'])} / "
                                          f"{fmt_bytes(b['optimizer'])}", f"ZeRO-{est['zero']}"),
        ("activations", fmt_bytes(b["activations"]),
         f"{fmt_bytes(est['activation_bytes_per_layer'])} per layer per micro-batch (recompute "
         f"{est['activation_recompute']}); without FlashAttention {fmt_bytes(modes['no_flash'])}, full recompute "
         f"{fmt_bytes(modes['full_recompute'])}"),
        ("recompute working set", fmt_bytes(b["recompute_working"]), "one layer rebuilt during backward"),
        ("fp32 logits", fmt_bytes(b["logits"]), "last stage only: 4 x s x b x V / tp"),
    ]))
    console.print(_table("Compute per step", [
        ("tokens", f"{est['tokens_per_step']:,}", f"{est['micro_batches']} micro-batches per replica"),
        ("FLOPs", fmt_flops(est["flops_per_step"]),
         f"6 x params x tokens, less {fmt_flops(est['embedding_flops_excluded_per_step'])} embedding, plus "
         f"{fmt_flops(est['attention_flops_per_step'])} attention ({est['attention_flops_convention']})"),
        ("step time", f"{est['step_time_s']:.3g} s", "FLOPs / (GPUs x peak x MFU)"),
        ("throughput", f"{est['tokens_per_s']:,.0f} tok/s", ""),
        ("pipeline bubble", f"{est['bubble_fraction']:.1%}",
         f"{est['pipeline_schedule']}; " + (f"timeline {est['bubble_fraction_timeline']:.1%}"
                                            if est["bubble_fraction_timeline"] is not None else "")
         + f" {est['pipeline_note']}"),
    ]))
    c = est["comm_bytes_per_step"]
    console.print(_table("Bytes one GPU sends per step", [
        ("data parallel", fmt_bytes(c["dp"]), f"gradients (ZeRO-{est['zero']})"),
        ("tensor parallel", fmt_bytes(c["tp"]), f"4 all-reduces per layer per micro-batch of "
                                                 f"{fmt_bytes(est['tp_allreduce_tensor_bytes'])}"),
        ("pipeline", fmt_bytes(c["pp"]), f"boundary tensor {fmt_bytes(est['pp_boundary_bytes'])}"),
        ("context parallel", fmt_bytes(c["cp"]), "K/V ring hops (or Ulysses all-to-alls)"),
        ("expert parallel", fmt_bytes(c["ep"]), "dispatch + combine all-to-alls"),
    ]))
    run = est.get("run")
    if run:
        console.print(_table("Whole run", [
            ("tokens", f"{run['total_tokens']:.3g}", ""),
            ("FLOPs", f"{run['flops']:.2e}", f"6 x params x tokens; {run['flops_with_attention']:.2e} with attention"),
            ("one GPU", f"{run['gpu_years']:,.0f} years", "at peak x MFU"),
            (f"{est['gpus']:,} GPUs", f"{run['days']:,.0f} days", ""),
        ]))


def estimate_command(config: str | None, preset: str | None, overrides: list[str], as_json: bool,
                     plot_dir: str | None) -> int:
    """Exit code 0, or 2 when the config or preset is bad (the error names the field)."""
    if config and preset:
        errors.print("[red]give a CONFIG or --preset NAME, not both[/red]")
        return 2
    try:
        cfg = load_preset(preset, overrides or []) if preset else load_config(config, overrides or [])
    except ConfigError as err:
        errors.print(f"[red]{err}[/red]")
        return 2
    try:
        est = estimate_run(cfg)
    except ValueError as err:
        errors.print(f"[red]cannot estimate {cfg.name}: {err}[/red]")
        return 2
    plots = []
    if plot_dir:
        from .plots import write_plots

        plots = [str(p) for p in write_plots(cfg, est, plot_dir)]
    if as_json:
        sys.stdout.write(json.dumps({**est, "plots": plots}) + "\n")
    else:
        print_summary(est)
        for p in plots:
            console.print(f"wrote {p}")
    return 0
