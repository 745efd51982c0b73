"""Serving throughput: the engine behind its OpenAI-compatible server at concurrency 32 against
Hugging Face `generate` (one request at a time, and static batches of 32) and llama.cpp's
llama-server (its f16 GGUF, the same load; built once into a cache, skipped where it cannot be) on
the same checkpoint and prompts, plus speculative decoding on repetitive code prompts (n-gram, the draft
model, and the ceiling: drafts that are the plain greedy output, accepted always and free to make). First, on
the fresh server, a concurrency sweep (1, 8, 32, 64, 128), 5 passes spread over the rounds: each size's
tokens/s (median pass; `over_previous`, the median of each pass's ratio to the size before) should be no lower
than the one before it. One JSON line per figure.

    python -m benchmarks.serve_throughput [MODEL_DIR] [--stream-interval N] [--serve-speculative ngram]
        [--enforce-eager] [--only-json-schema] [--device cuda --dtype bfloat16 --kv-cache-memory-gb 16]
        [--concurrency-sweep 1 32 128] [--baseline hf] [--no-speculative] [--no-json-schema] ...
        (default: a tiny checkpoint trained briefly on code; the engine hands tokens out 4 at a time,
        its default, its decode step is compiled at start-up, and the served load does not speculate)

The json_schema row (`serve_json_schema`) runs the served load again with response_format
json_schema: `ratio` is its output tokens/s over the plain load's (the issue asks >= 0.75).
`--only-json-schema` runs just the served load and that row (no baselines, no speculation).
"""

from __future__ import annotations

import sys

from stages.serve.bench import bench_serve_command


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="serve_throughput")
    p.add_argument("model_dir", nargs="?", default=None)
    p.add_argument("--stream-interval", type=int, default=None,
                   help="engine option: hand tokens out N at a time (default 4; 1 streams every token)")
    p.add_argument("--serve-speculative", choices=["ngram"], default=None,
                   help="the served load speculates too (greedy output unchanged; HF's baseline does not)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the engines eagerly (default: the decode step compiled, as `eightfold serve` runs it)")
    p.add_argument("--no-json-schema", action="store_true", help="skip the json_schema load")
    p.add_argument("--only-json-schema", action="store_true",
                   help="only the served load and its json_schema twin (no HF baselines, in-process engine or speculation)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="the engines and Hugging Face's model on this device (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="their compute dtype (default float32; bfloat16 on a GPU)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="engine option: the KV cache's budget")
    p.add_argument("--num-prompts", type=int, default=192, help="requests per round")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spec-repeats", type=int, default=9,
                   help="plain and speculative decodes alternate this many times (~0.5 s each); the median ratio counts")
    p.add_argument("--concurrency-sweep", type=int, nargs="+", default=[1, 8, 32, 64, 128], metavar="C")
    p.add_argument("--sweep-passes", type=int, default=5, help="passes of the sweep, spread over the rounds")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and the baselines")
    p.add_argument("--baseline", nargs="*", choices=["hf", "llama.cpp"], default=["hf", "llama.cpp"],
                   help="baselines to run (none: --baseline with no value)")
    p.add_argument("--no-speculative", action="store_true", help="skip the speculative decoding figures")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process engine's figure")
    p.add_argument("--server", choices=["process", "thread"], default="process")
    p.add_argument("--engine-process", choices=["true", "false"], default=None,
                   help="the server's --engine-process (default: its own default, the engine core in a process "
                        "of its own; false: the engine on a thread of the server's process)")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ns = p.parse_args(argv)
    if ns.dtype is None and ns.device == "cuda":
        ns.dtype = "bfloat16"
    opts = {"stream_interval": ns.stream_interval} if ns.stream_interval else {}
    opts.update({k: v for k, v in (("device", ns.device), ("dtype", ns.dtype),
                                   ("kv_cache_memory_gb", ns.kv_cache_memory_gb)) if v is not None})
    if ns.enforce_eager:
        opts["enforce_eager"] = True
    if ns.serve_speculative:
        opts["serve_speculative"] = ns.serve_speculative
    if ns.only_json_schema:
        opts.update(baseline=None, speculative=False, in_process=False)
    else:
        opts.update(baseline=ns.baseline or None, speculative=not ns.no_speculative,
                    concurrency_sweep=ns.concurrency_sweep, sweep_passes=ns.sweep_passes,
                    in_process=not ns.no_in_process,
                    # the default checkpoint comes with a draft model; the ceiling bounds every proposer's speedup
                    speculative_methods=(["draft"] if ns.model_dir is None else []) + ["ceiling"])
    return bench_serve_command(ns.model_dir, num_prompts=ns.num_prompts, concurrency=32, input_len=ns.input_len,
                               output_len=ns.output_len, range_ratio=0.75, json_schema=not ns.no_json_schema,
                               rounds=ns.rounds, spec_repeats=ns.spec_repeats, threads=ns.threads, server=ns.server,
                               out=ns.out,
                               engine_process=None if ns.engine_process is None else ns.engine_process == "true", **opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
