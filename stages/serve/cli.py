"""`python -m stages.serve.cli serve MODEL_DIR ...` and `... bench ...`: the serve stage's command
line without the project CLI (the benchmark starts its server this way, in its own process).
Every EngineConfig field is an option (`--max-num-seqs 32`, `--speculative ngram`, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

from .engine import EngineConfig


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes"):
        return True
    if s.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        t = hints[f.name]
        args = typing.get_args(t)
        base = next((a for a in args if a is not type(None)), t) if args else t
        flag = "--" + f.name.replace("_", "-")
        if f.name == "enforce_eager":  # vLLM's flag: bare `--enforce-eager` turns compilation off
            p.add_argument(flag, nargs="?", const=True, type=_bool, default=None, metavar="BOOL",
                           help="run the forward eagerly (default here: compiled, warmed up at start)")
        elif base is bool:
            p.add_argument(flag, type=_bool, default=None, metavar="BOOL")
        else:
            p.add_argument(flag, type=base, default=None)


def _engine_options(ns: argparse.Namespace) -> dict:
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineConfig) if getattr(ns, f.name) is not None}


def main(argv: list[str] | None = None, bench_prog: str | None = None) -> int:
    """`bench_prog`: the name the bench command's usage and help go by (`eightfold bench serve`)."""
    parser = argparse.ArgumentParser(prog="python -m stages.serve.cli")
    sub = parser.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible server on a Hugging Face checkpoint folder")
    s.add_argument("model_dir")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None)
    s.add_argument("--request-log", default=None, help="JSONL file of prompts and outputs (opt-in)")
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--canary-model-dir", default=None)
    s.add_argument("--canary-share", type=float, default=0.0)
    s.add_argument("--prefill-replicas", type=int, default=0,
                   help="prefill/decode disaggregation: this many prefill engines ship K/V to the --replicas "
                        "decode engines (disagg.py); 0: every engine does both")
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    s.add_argument("--engine-process", nargs="?", const=True, type=_bool, default=None, metavar="BOOL",
                   help="step the engine core in a process of its own, the HTTP server in this one (vLLM's "
                        "layout). Default: on with one replica and no canary or disaggregation, which it cannot "
                        "serve; false keeps the engine on a thread of the server's process")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT LoRA adapters served under their own model names (vLLM's option: NAME=PATH or "
                        "JSON {\"name\": ..., \"path\": ...}); VLLM_ALLOW_RUNTIME_LORA_UPDATING=true also serves "
                        "/v1/load_lora_adapter and /v1/unload_lora_adapter")
    _add_engine_options(s)

    b = sub.add_parser("bench", help="load benchmark (like `vllm bench serve`)",
                       description="Load benchmark like `vllm bench serve`: one JSON line per figure (TTFT, TPOT, "
                                   "ITL, e2e latency, output tokens/s; with --baseline, ratios against it).",
                       **({"prog": bench_prog} if bench_prog else {}))
    b.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face checkpoint folder to serve (default: a tiny one built and cached on the spot)")
    b.add_argument("--base-url", default=None, help="load a server already running there instead of starting one")
    b.add_argument("--num-prompts", type=int, default=192, help="requests per round")
    b.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    b.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (inf: all at once)")
    b.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens, mean (default 64, scaled down with --output-len to fit the model's context)")
    b.add_argument("--output-len", type=int, default=None, help="output tokens, mean (default 128, see --input-len)")
    b.add_argument("--range-ratio", type=float, default=0.75,
                   help="lengths are uniform in [len*(1-r), len*(1+r)]")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--baseline", choices=["hf", "llama.cpp"], nargs="+", default=None,
                   help="also run Hugging Face generate on the same prompts (one at a time, static batches), "
                        "and/or llama.cpp's llama-server on the f16 GGUF under the same load")
    b.add_argument("--speculative-bench", dest="spec", action="store_true",
                   help="also time speculative decoding (n-gram, and the draft model) against plain decoding")
    b.add_argument("--speculative", dest="spec_methods", nargs="+", choices=["ngram", "draft", "mtp", "ceiling"],
                   default=None, help="time these proposers against plain decoding, n-gram's beside them (implies "
                        "--speculative-bench; mtp: the checkpoint's own MTP modules, k = min(--num-speculative-tokens, "
                        "its depth); ceiling: drafts that are the plain greedy output, always accepted and free: the "
                        "most any proposer can give at that k on this machine)")
    b.add_argument("--spec-prompts-file", default=None,
                   help="JSON list of prompts for the speculative timing (default: repetitive code)")
    b.add_argument("--spec-prompts", type=int, default=4, help="prompts decoded one at a time per speculative round")
    b.add_argument("--spec-output-len", type=int, default=128, help="tokens decoded per speculative prompt")
    b.add_argument("--spec-repeats", type=int, default=9,
                   help="plain and speculative decodes alternate this many times; the median ratio is reported")
    b.add_argument("--draft-model-dir", default=None, help="draft checkpoint for --speculative-bench")
    b.add_argument("--threads", type=int, default=1, help="torch threads of the server and the baselines")
    b.add_argument("--out", default=None, help="also write the JSON lines to this file")
    b.add_argument("--server", choices=["process", "thread"], default="process",
                   help="the server in its own process (default) or a thread of this one")
    b.add_argument("--rounds", type=int, default=3, help="repeat and report the median round")
    b.add_argument("--max-num-seqs", type=int, default=None, help="engine option (default: max(concurrency, 64))")
    b.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine option: tokens per step at most")
    b.add_argument("--stream-interval", type=int, default=None, help="engine option: hand tokens out N at a time")
    b.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="engine option: where the engines and the Hugging Face baseline run (default cpu)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="engine option: compute dtype of the engines and the Hugging Face baseline (default float32)")
    b.add_argument("--kv-cache-memory-gb", type=float, default=None, help="engine option: the KV cache's budget")
    b.add_argument("--serve-speculative", choices=["ngram"], default=None,
                   help="the served load speculates too (greedy output unchanged)")
    b.add_argument("--num-speculative-tokens", type=int, default=5, help="draft tokens proposed per step")
    b.add_argument("--enforce-eager", nargs="?", const=True, type=_bool, default=None, metavar="BOOL",
                   help="the engines run eagerly (default: compiled, as `serve` runs them)")
    b.add_argument("--json-schema", action="store_true",
                   help="also run the load with response_format json_schema and report its tokens/s over the plain load's")
    b.add_argument("--concurrency-sweep", type=int, nargs="+", default=None, metavar="C",
                   help="first on the fresh server, loads at each of these concurrencies in turn (e.g. 1 8 32 64 "
                        "128), --sweep-passes times: one serve_concurrency line each, its median pass")
    b.add_argument("--sweep-passes", type=int, default=5,
                   help="passes of the concurrency sweep, spread over the rounds (default 5)")
    b.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="service-level objectives in ms (ttft, tpot, e2el), e.g. ttft:500 tpot:50: also report "
                        "request_goodput, the requests/s meeting all of them")
    ns = parser.parse_args(argv)

    if ns.cmd == "serve":
        if ns.threads:
            import torch

            torch.set_num_threads(ns.threads)
        from .server import serve_command

        if ns.enforce_eager is None:  # a server compiles by default (vLLM's default too); the library stays eager
            ns.enforce_eager = False
        return serve_command(ns.model_dir, ns.host, ns.port, ns.api_key, request_log=ns.request_log,
                             replicas=ns.replicas, canary_model_dir=ns.canary_model_dir,
                             canary_share=ns.canary_share, prefill_replicas=ns.prefill_replicas,
                             lora_modules=ns.lora_modules, engine_process=ns.engine_process, threads=ns.threads,
                             **_engine_options(ns))
    from .bench import bench_serve_command, parse_goodput

    try:
        parse_goodput(ns.goodput)
    except ValueError as e:
        b.error(str(e))  # usage and the message on stderr, exit code 2
    opts = {k: v for k, v in (("max_num_seqs", ns.max_num_seqs), ("max_num_batched_tokens", ns.max_num_batched_tokens),
                              ("stream_interval", ns.stream_interval), ("enforce_eager", ns.enforce_eager),
                              ("device", ns.device), ("dtype", ns.dtype), ("kv_cache_memory_gb", ns.kv_cache_memory_gb))
            if v is not None}
    try:
        return bench_serve_command(ns.model_dir, num_prompts=ns.num_prompts, concurrency=ns.concurrency,
                                   request_rate=ns.request_rate, input_len=ns.input_len, output_len=ns.output_len,
                                   range_ratio=ns.range_ratio, seed=ns.seed, baseline=ns.baseline,
                                   speculative=ns.spec or bool(ns.spec_methods), speculative_methods=ns.spec_methods,
                                   spec_prompts_file=ns.spec_prompts_file, spec_prompts=ns.spec_prompts,
                                   spec_output_len=ns.spec_output_len, spec_repeats=ns.spec_repeats,
                                   draft_model_dir=ns.draft_model_dir, threads=ns.threads, base_url=ns.base_url,
                                   out=ns.out, server=ns.server, rounds=ns.rounds, serve_speculative=ns.serve_speculative,
                                   num_speculative_tokens=ns.num_speculative_tokens, goodput=ns.goodput,
                                   json_schema=ns.json_schema, concurrency_sweep=ns.concurrency_sweep,
                                   sweep_passes=ns.sweep_passes, **opts)
    except Exception as e:  # noqa: BLE001 - a command line's errors are one line (EIGHTFOLD_DEBUG=1: the traceback)
        if os.environ.get("EIGHTFOLD_DEBUG"):
            raise
        print(f"bench serve: error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
