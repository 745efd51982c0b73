"""Serving throughput: the engine behind its OpenAI-compatible server at concurrency 32 against
Hugging Face `generate` (one request at a time, and static batches of 32) on the same checkpoint
and prompts, plus speculative decoding on repetitive code prompts. One JSON line per figure.

    python -m benchmarks.serve_throughput [MODEL_DIR]   (default: a tiny checkpoint trained briefly on code)
"""

from __future__ import annotations

import sys

from stages.serve.bench import bench_serve_command


def main(argv: list[str]) -> int:
    model_dir = argv[0] if argv else None
    return bench_serve_command(model_dir, num_prompts=192, concurrency=32, input_len=64, output_len=128,
                               range_ratio=0.75, baseline="hf", speculative=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
