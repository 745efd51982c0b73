"""The load benchmark end to end on the tiny checkpoint (a smoke run: tiny numbers, every figure
present and sane), and the serve stage's smoke test + manifests."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest


@pytest.mark.slow
def test_bench_serve_reports_every_figure(tiny_hf_model_dir, tiny_hf_draft_dir, tmp_path, capsys):
    from stages.serve.bench import bench_serve_command

    out = tmp_path / "bench.jsonl"
    rc = bench_serve_command(str(tiny_hf_model_dir), num_prompts=6, concurrency=3, input_len=16, output_len=8,
                             baseline="hf", baseline_sequential_requests=2, speculative=True,
                             draft_model_dir=str(tiny_hf_draft_dir), spec_prompts=1, spec_output_len=16,
                             rounds=1, server="process", out=str(out), num_kv_blocks=64,
                             enforce_eager=True)  # compiling would cost the suite ~10-40 s
    assert rc == 0
    lines = {d["figure"]: d for d in map(json.loads, out.read_text().splitlines())}
    serve = lines["serve"]
    assert serve["completed"] == 6 and serve["failed"] == 0
    from transformers import AutoTokenizer

    from stages.serve.bench import make_requests

    # ignore_eos: every request runs to exactly its drawn output length
    want = make_requests(AutoTokenizer.from_pretrained(str(tiny_hf_model_dir)), 6, 16, 8, 0.75, 0)
    assert serve["output_tokens"] == sum(r.output_len for r in want)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(serve[key]) == {"mean", "median", "p99"} and serve[key]["p99"] >= serve[key]["median"] > 0
    assert serve["output_tokens_per_s"] > 0
    for b in ("baseline_hf_sequential", "baseline_hf_static"):
        assert lines[b]["baseline_output_tokens_per_s"] > 0
        assert lines[b]["ratio"] == pytest.approx(serve["output_tokens_per_s"] / lines[b]["baseline_output_tokens_per_s"])
    for kind in ("speculative_ngram", "speculative_draft"):
        assert lines[kind]["identical_greedy"] is True and lines[kind]["spec_speedup"] > 0
        assert lines[kind]["spec_speedup_cpu"] > 0 and len(lines[kind]["rounds_spec_speedup"]) == 1  # rounds=1
        assert 0 <= lines[kind]["acceptance_rate"] <= 1


def test_serve_stage_checks_the_checkpoint_and_writes_manifests(tiny_hf_model_dir, tmp_path):
    import yaml

    from infra.config import load_config
    from stages.serve.stage import run

    export = tmp_path / "export"
    (export / "hf").mkdir(parents=True)
    for f in tiny_hf_model_dir.iterdir():
        (export / "hf" / f.name).write_bytes(f.read_bytes())
    load = ["serve.load_requests=8", "serve.load_concurrency=4", "serve.load_input_len=16", "serve.load_output_len=8"]
    ctx = SimpleNamespace(cfg=load_config("configs/tiny.yaml", load), inputs={"export": export},
                          input_uris={"export": "s3://bucket/exp/export/fp"}, out_dir=tmp_path / "out",
                          log_metrics=lambda *a, **k: None)
    figures = run(ctx)
    assert figures["matches_hf"] is True
    card = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert card["model_uri"] == "s3://bucket/exp/export/fp/hf"
    # the load test went through the real server: every request answered, latencies measured
    assert card["load"]["completed"] == 8 and card["load"]["failed"] == 0
    assert 0 < figures["ttft_ms_median"] <= figures["e2e_ms_median"] and figures["output_tokens_per_s"] > 0
    dep = next(yaml.safe_load_all((tmp_path / "out" / "vllm.yaml").read_text()))
    assert dep["kind"] == "Deployment"
