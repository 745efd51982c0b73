"""`eightfold estimate [CONFIG | --preset NAME] [--set ...] [--json] [--plot DIR] [--serve]`: a readable
summary (rich) by default, one JSON object with stable keys for scripts, PNGs on request, and with --serve
the serving view (KV capacity, TTFT, TPOT and throughput by concurrency; `--set estimate.serve.*`)."""

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
    c, secs, links = est["comm_bytes_per_step"], est["comm_time_s_per_step"], est["comm_links"]
    bw = est["link_bandwidth"]
    dp_link = links.get("dp_cp") or links["dp_shard"]

    def took(dim: str, link: dict) -> str:
        if not c[dim]:
            return ""
        where = "NVLink" if link["link"] == "nvlink" else f"network ({link['nodes_spanned']} nodes)"
        return f"{fmt_seconds(secs[dim])} on {where}; "

    console.print(_table(f"Bytes one GPU sends per step (NVLink {bw['nvlink'] / 1e9:.0f} GB/s, network "
                         f"{bw['network'] / 1e9:.0f} GB/s per GPU)", [
        ("data parallel", fmt_bytes(c["dp"]), took("dp", dp_link) + f"gradients (ZeRO-{est['zero']}), overlaps backward"),
        ("tensor parallel", fmt_bytes(c["tp"]), took("tp", links["tp"]) + f"4 all-reduces per layer per micro-batch of "
                                                 f"{fmt_bytes(est['tp_allreduce_tensor_bytes'])}, on the critical path"),
        ("pipeline", fmt_bytes(c["pp"]), took("pp", links["pp"]) + f"boundary tensor {fmt_bytes(est['pp_boundary_bytes'])}"),
        ("context parallel", fmt_bytes(c["cp"]), took("cp", links["cp"]) + "K/V ring hops (or Ulysses all-to-alls)"),
        ("expert parallel", fmt_bytes(c["ep"]), took("ep", links["ep"]) + "dispatch + combine all-to-alls"),
    ]))
    print_serving(est, full=False)
    run = est.get("run")
    if run:
        console.print(_table("Whole run", [
            ("tokens", f"{run['total_tokens']:.3g}", ""),
            ("FLOPs", f"{run['flops']:.2e}", f"6 x params x tokens; {run['flops_with_attention']:.2e} with attention"),
            ("one GPU", f"{run['gpu_years']:,.0f} years", "at peak x MFU"),
            (f"{est['gpus']:,} GPUs", f"{run['days']:,.0f} days", ""),
        ]))
    print_warnings(est)


def print_warnings(est: dict) -> None:
    for w in est["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")


def fmt_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


BOUND = {"weights": "weight reads", "kv_reads": "KV reads", "compute": "compute"}
KNEE = {"kv_reads": "the batch's KV reads reach the weight reads", "compute": "the step turns compute-bound",
        "kv_capacity": "the KV cache fills memory", "weights_do_not_fit": "the weights do not fit"}


def print_serving(est: dict, full: bool = True) -> None:
    """The serving estimate: a few lines in the summary; with `full` the whole table by concurrency."""
    sv = est["serve"]
    pre = sv["prefill"]
    knee = sv["knee_concurrency"]
    console.print(_table(
        f"Serving on {sv['tp']} GPU{'s' if sv['tp'] > 1 else ''} per replica ({sv['weight_dtype']} weights, "
        f"{sv['kv_dtype']} KV cache, {sv['prompt_len']} prompt + {sv['output_len']} output tokens)", [
            ("weights", fmt_bytes(sv["weight_bytes"]), f"{fmt_bytes(sv['weight_bytes_per_gpu'])} per GPU; a decode "
                                                      f"step at concurrency 1 reads {fmt_bytes(sv['weight_read_bytes_per_step'])}"),
            ("KV cache per token", fmt_bytes(sv["kv_bytes_per_token"]), f"{fmt_bytes(sv['kv_bytes_per_token_per_gpu'])} per GPU"),
            ("KV capacity", f"{sv['max_concurrency']:,} sequences",
             f"{sv['kv_capacity_tokens']:,.0f} tokens after the weights and a {sv['memory_reserve']:.0%} reserve, "
             f"at {sv['context']} tokens each"),
            ("TTFT", fmt_seconds(sv["ttft_s"]), f"prefill, {pre['bound']}-bound: {fmt_flops(pre['flops'])} at "
                                                 f"{sv['prefill_mfu']:.0%} MFU vs one read of the weights"),
            ("TPOT at 1 sequence", fmt_seconds(sv["tpot_s"]), f"{sv['tokens_per_s_one']:,.0f} tok/s: bytes / "
                                                              f"{sv['gpu_memory_bandwidth'] / 1e12:.2f} TB/s"),
            ("peak throughput", f"{sv['peak_tokens_per_s']:,.0f} tok/s", "at the KV limit, per replica"),
            ("knee", f"{knee:,}" if knee else "-", KNEE[sv["knee_reason"]]),
        ]))
    for note in sv["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
    if not full or not sv["table"]:
        return
    t = Table(title="Decode by concurrency (roofline: max(bytes / bandwidth, FLOPs / peak) + TP all-reduces; "
                    "bytes per GPU; * past the knee)",
              title_justify="left", box=None, pad_edge=False)
    for name in ("concurrency", "TPOT", "tok/s", "x conc. 1", "weights read", "KV read", "bound"):
        t.add_column(name, justify="right")
    base = sv["table"][0]["tokens_per_s"]
    marked = False
    for r in sv["table"]:
        mark = " *" if knee and r["concurrency"] >= knee and not marked else ""  # the first row past the knee
        marked = marked or bool(mark)
        t.add_row(f"{r['concurrency']:,}", fmt_seconds(r["tpot_s"]), f"{r['tokens_per_s']:,.0f}",
                  f"{r['tokens_per_s'] / base:.2f}", fmt_bytes(r["weight_bytes"]), fmt_bytes(r["kv_bytes"]),
                  BOUND[r["bound"]] + mark)
    console.print(t)


def estimate_command(config: str | None, preset: str | None, overrides: list[str], as_json: bool,
                     plot_dir: str | None, serve: bool = False) -> int:
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
    elif serve:
        console.print(f"[bold]{est['config']}[/bold]: {est['gpu_peak_flops'] / 1e12:.0f} TFLOP/s peak, "
                      f"{est['serve']['gpu_memory_bandwidth'] / 1e12:.2f} TB/s, {fmt_bytes(est['gpu_memory_bytes'])} per GPU")
        print_serving(est, full=True)
        for p in plots:
            console.print(f"wrote {p}")
    else:
        print_summary(est)
        for p in plots:
            console.print(f"wrote {p}")
    return 0
