"""Serving throughput: the engine behind its OpenAI-compatible server at concurrency 32 against
Hugging Face `generate` (one request at a time, and static batches of 32) and llama.cpp's
llama-server (its f16 GGUF, the same load; built once into a cache, skipped where it cannot be) on
the same checkpoint and prompts, plus speculative decoding on repetitive code prompts. First, on
the fresh server, a concurrency sweep (1, 8, 32, 64, 128): each size's tokens/s should be no lower
than the one before it. One JSON line per figure.

    python -m benchmarks.serve_throughput [MODEL_DIR] [--stream-interval N] [--serve-speculative ngram]
        [--enforce-eager] [--only-json-schema]
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
    p.add_argument("--only-json-schema", action="store_true",
                   help="only the served load and its json_schema twin (no HF baselines, in-process engine or speculation)")
    ns = p.parse_args(argv)
    opts = {"stream_interval": ns.stream_interval} if ns.stream_interval else {}
    if ns.enforce_eager:
        opts["enforce_eager"] = True
    if ns.serve_speculative:
        opts["serve_speculative"] = ns.serve_speculative
    if ns.only_json_schema:
        opts.update(baseline=None, speculative=False, in_process=False)
    else:
        opts.update(baseline=["hf", "llama.cpp"], speculative=True, concurrency_sweep=[1, 8, 32, 64, 128])
    return bench_serve_command(ns.model_dir, num_prompts=192, concurrency=32, input_len=64, output_len=128,
                               range_ratio=0.75, json_schema=True, **opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
