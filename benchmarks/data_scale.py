"""How the data stage's cost grows with work: `run_clean` (the datatrove pipeline) on 1x, 4x and 16x the tiny
corpus, then 1 against 2 workers.

The tiny corpus is the tiny config's source (the running Python's standard library, ~6 MB). The Nx corpus is
it plus N-1 copies, each document of a copy lightly edited (a few words replaced, seeded), so dedup has real
near-duplicates to find across shards; all of it is written as ~256 KB JSON-lines files. Each run is a fresh
process (`--run`), whose process tree (the stage and its workers) is sampled for its total resident memory.

Prints one JSON line per size: {"size", "docs", "docs_kept", "seconds", "docs_per_s", "peak_rss_mb",
"workers", "load_average_1m"}, then one line {"speedup_2_workers", ...} per `--speedup-sizes` corpus with the
medians of `--repeats` runs of each worker count (not 1x: there a pool's start-up, ~0.9 s, is a third of the run;
at 4x still a tenth, at 16x a fortieth). The machine's load is printed with every line: on a shared machine the
figures move with it.

    python -m benchmarks.data_scale [--sizes 1,4,16] [--speedup-sizes 4,16] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FILE_BYTES = 256 * 1024
_WORD = re.compile(r"\w+")


def edit(text: str, seed: int, fraction: float = 0.002) -> str:
    """Replace about `fraction` of the words (at least one): a near-duplicate of the original."""
    rng = random.Random(seed)
    words = list(_WORD.finditer(text))
    if not words:
        return text
    chosen = set(rng.sample(range(len(words)), max(1, int(len(words) * fraction))))
    parts, last = [], 0
    for i, m in enumerate(words):
        if i in chosen:
            parts += [text[last:m.start()], f"w{rng.randrange(10**6)}"]
            last = m.end()
    return "".join(parts) + text[last:]


def tiny_corpus(max_bytes: int) -> list[str]:
    from infra.config.data import SourceConfig
    from stages.data.sources import SourceReader

    src = SourceConfig(name="python-stdlib", kind="python_source", max_bytes=max_bytes)
    return [d.text for d in SourceReader(src, 4 * 200_000)]


def write_corpus(texts: list[str], copies: int, out: Path) -> int:
    """The originals then `copies - 1` edited copies, as JSON-lines files of about FILE_BYTES; returns documents."""
    out.mkdir(parents=True)
    k, buf, size, n = 0, [], 0, 0

    def flush():
        nonlocal k, buf, size
        if buf:
            (out / f"{k:05d}.jsonl").write_text("".join(buf))
            k, buf, size = k + 1, [], 0

    for c in range(copies):
        for i, t in enumerate(texts):
            line = json.dumps({"text": t if c == 0 else edit(t, seed=c * 1_000_003 + i)}) + "\n"
            buf.append(line)
            size += len(line)
            n += 1
            if size >= FILE_BYTES:
                flush()
    flush()
    return n


def run_once(corpus: Path, workers: int) -> dict:
    """The stage in this process (called with --run in a fresh one)."""
    from infra.config import load_config
    from infra.config.data import DataConfig, SourceConfig
    from infra.workspace import Workspace
    from stages.base import StageContext
    from stages.data import run_clean

    cfg = load_config("tiny")
    cfg.data = DataConfig(sources=[SourceConfig(name="corpus", path=str(corpus))], workers=workers)
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        cfg.infra.workdir = str(Path(tmp) / "ws")
        t = time.perf_counter()
        s = run_clean(StageContext(cfg, Workspace.from_config(cfg), Path(tmp) / "out"))
        seconds = time.perf_counter() - t
    return {"docs": s["documents_in"], "docs_kept": s["documents_out"], "seconds": round(seconds, 2),
            "docs_per_s": round(s["documents_in"] / seconds, 2), "tasks": s["tasks"]}


def measured(corpus: Path, workers: int) -> dict:
    """A fresh process running the stage, its tree's resident memory sampled every 0.1 s."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.data_scale", "--run", str(corpus), "--workers",
                             str(workers)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root] + root.children(recursive=True)
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = proc.communicate()
    done.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"run on {corpus} with {workers} workers failed (exit {proc.returncode})")
    res = json.loads(out.strip().splitlines()[-1])
    return {**res, "peak_rss_mb": round(peak / 2**20, 1), "workers": workers,
            "load_average_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--workers", type=int, default=2, help="workers for the size runs")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each worker count for the speedup (median)")
    ap.add_argument("--max-bytes", type=int, default=6_000_000)
    ap.add_argument("--speedup-sizes", default="4,16", help="corpus sizes (x tiny) of the 1 vs 2 workers runs")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        print(json.dumps(run_once(Path(args.run), args.workers)), flush=True)
        return
    texts = tiny_corpus(args.max_bytes)
    with tempfile.TemporaryDirectory(prefix="data-scale-corpus-") as tmp:
        corpora = {}
        speedup_sizes = sorted(int(x) for x in args.speedup_sizes.split(","))
        for n in sorted({int(x) for x in args.sizes.split(",")} | set(speedup_sizes)):
            corpora[n] = Path(tmp) / f"{n}x"
            write_corpus(texts, n, corpora[n])
        for n in sorted(int(x) for x in args.sizes.split(",")):
            print(json.dumps({"size": f"{n}x", **measured(corpora[n], args.workers)}), flush=True)
        for n in speedup_sizes:
            rates = {1: [], 2: []}
            for _ in range(args.repeats):
                for w in (1, 2):
                    rates[w].append(measured(corpora[n], w)["docs_per_s"])
            med = {w: statistics.median(r) for w, r in rates.items()}
            print(json.dumps({"speedup_2_workers": round(med[2] / med[1], 3), "size": f"{n}x",
                              "docs_per_s_1_worker": med[1], "docs_per_s_2_workers": med[2], "repeats": args.repeats,
                              "runs_1_worker": rates[1], "runs_2_workers": rates[2], "cpus": os.cpu_count(),
                              "load_average_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
