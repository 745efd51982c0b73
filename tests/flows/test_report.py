"""The end-of-run report on a real micro lifecycle (data, tokenizer, tokens) plus synthetic artifacts
for the later stages (pretrain with a loss history, ablations with a scaling-law PNG, evaluate with
its comparison table, serve with latency figures); and `eightfold compare` on two real lifecycle runs
that differ in one config value."""

import base64
import json
import re

import matplotlib
import pytest

from infra.artifacts import commit_artifact
from infra.config import load_config
from infra.tracking import Tracker
from infra.workspace import Workspace

pytestmark = pytest.mark.slow

STAGES = ["data", "tokenizer", "tokens"]


@pytest.fixture(scope="module")
def micro(tmp_path_factory, prefect_harness):
    """Two lifecycle runs: the micro config, then the same with pretrain.seq_len=32 (only `tokens`
    depends on it among these stages). Yields (cfg, first result, second result, work dir)."""
    from flows.lifecycle import lifecycle

    work = tmp_path_factory.mktemp("report") / "work"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EIGHTFOLD_WORKDIR", str(work))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("PREFECT_API_URL", raising=False)
        first = lifecycle(config="micro", stages=STAGES)
        second = lifecycle(config="micro", stages=STAGES, overrides=["pretrain.seq_len=32"])
        yield load_config("micro"), first, second, work


def _fake_artifact(ws, stage, fp, files: dict[str, bytes], summary, tmp_path, run_id=None):
    folder = tmp_path / stage
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    extra = {"summary": summary, **({"mlflow_run_id": run_id} if run_id else {})}
    art = commit_artifact(ws.store, ws.experiment, stage, fp, folder, config={}, extra=extra)
    return {"stage": stage, "fingerprint": fp, "uri": art.uri, "cached": False, "summary": summary}


def _png(tmp_path) -> bytes:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.loglog([1e15, 1e16, 1e17], [3.0, 2.6, 2.3], "o-")
    ax.set_title("scaling fit")
    fig.savefig(tmp_path / "fit.png")
    plt.close(fig)
    return (tmp_path / "fit.png").read_bytes()


def test_report_full_and_partial(micro, tmp_path, monkeypatch):
    from flows.report import print_summary, write_report

    cfg, first, _, work = micro
    monkeypatch.setenv("EIGHTFOLD_WORKDIR", str(work))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ws = Workspace.from_config(cfg)

    # Synthetic later stages. Pretrain: MLflow holds the loss history (final 2.25) and metrics.jsonl a
    # different one (final 9.0): the report must take MLflow's, since the manifest names that run.
    tracker = Tracker(ws.tracking_uri, ws.experiment)
    run_id = tracker.start_run("pretrain-fake", tags={"stage": "pretrain"})
    for step, loss in enumerate([6.0, 4.0, 3.0, 2.25]):
        tracker.log_metrics(run_id, {"loss": loss, "lr": 1e-3}, step=step)
    tracker.log_metrics(run_id, {"val_loss": 3.5}, step=1)
    tracker.log_metrics(run_id, {"val_loss": 2.5}, step=3)
    tracker.end_run(run_id)
    jsonl = "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in enumerate([9.5, 9.0])).encode()
    refs = dict(first)
    refs["pretrain"] = _fake_artifact(ws, "pretrain", "1" * 16, {"metrics.jsonl": jsonl}, {"steps": 4}, tmp_path, run_id)
    refs["ablations"] = _fake_artifact(ws, "ablations", "2" * 16, {"plots/scaling_fit.png": _png(tmp_path)},
                                       {"alpha": 0.3}, tmp_path)
    table = "| variant | arc_easy/acc ↑ |\n|---|---|\n| hf | 0.312 |\n| int8 | 0.298 |\n\nExamples per task: arc_easy=50\n"
    refs["evaluate"] = _fake_artifact(ws, "evaluate", "3" * 16, {"evaluation.md": table.encode()}, {"variants": 2}, tmp_path)
    refs["serve"] = _fake_artifact(ws, "serve", "4" * 16, {"bench.jsonl": b"{}\n"},
                                   {"ttft_ms_p50": 41.5, "latency_ms_p99": 120.25}, tmp_path)
    refs["posttrain-rm"] = _fake_artifact(ws, "posttrain-rm", "6" * 16, {"posttrain.json": b"{}"}, {
        "pairwise_accuracy_after": 0.7708, "pairwise_accuracy_after_se": 0.0116, "pairs_n": 1344,
        "pairwise_accuracy_z": 23.62, "sft_preference_accuracy_before": 0.7537}, tmp_path)
    refs["posttrain-ppo"] = _fake_artifact(ws, "posttrain-ppo", "7" * 16, {"posttrain.json": b"{}"}, {
        "heldout_accuracy_before": 0.2946, "heldout_accuracy_after": 0.3259, "heldout_accuracy_gain": 0.0312,
        "heldout_accuracy_gain_se": 0.0312, "heldout_reward_before": -1.6175, "heldout_reward_after": -1.3859,
        "heldout_reward_gain": 0.2316, "heldout_reward_gain_se": 0.2649, "train_kl": 0.4313, "train_kl_coef": 0.05},
        tmp_path)

    path = print_summary(cfg, refs)
    assert path == ws.workdir / "report" / "micro" / "report.md"
    md = path.read_text()
    html = path.with_suffix(".html").read_text()
    for stage in STAGES:  # real stages: ran, their fingerprint and artifact
        assert re.search(rf"\| {stage} \| ran \| `{first[stage]['fingerprint']}` \|.*\| `{re.escape(first[stage]['uri'])}` \|", md)
    assert re.search(r"\| loss \| 3 \| 2\.2500 \| 2\.2500 \|", md) and re.search(r"\| val_loss \| 3 \| 2\.5000 \|", md)
    assert "9.0000" not in md
    assert "![plots/scaling_fit.png" in md and (path.parent / "ablations_plots_scaling_fit.png").is_file()
    assert "| int8 | 0.298 |" in md and "<td>int8</td><td>0.298</td>" in html
    assert "| ttft_ms_p50 | 41.5 |" in md and "| latency_ms_p99 | 120.2 |" in md
    assert "eightfold serve --latest" in md and "mlflow ui --backend-store-uri" in md
    assert "This run in MLflow: `lifecycle-" in md
    # classic RLHF: the reward model's ranking and PPO's reward and KL beside the accuracy table
    assert "| posttrain-ppo | 0.295 -> 0.326 | +0.031 (0.031) |" in md and "| posttrain-rm | - -> -" not in md
    assert ("| posttrain-rm | pairwise accuracy 0.771 ± 0.012 on 1344 held-out pairs, 23.6 SE above chance; "
            "the SFT model's likelihood ranks 0.754 |") in md
    assert "| posttrain-ppo | held-out reward -1.617 -> -1.386, gain +0.232 (0.265); KL to SFT per sequence 0.431 " \
           "at coefficient 0.05 |" in md
    # Self-contained HTML: both PNGs inline and decodable.
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == 2 and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    loss_png = path.parent / "loss_curves.png"
    assert loss_png.stat().st_size > 10_000

    # Without MLflow history for pretrain the job's metrics.jsonl is the source; later stages missing.
    refs2 = dict(first)
    refs2["pretrain"] = _fake_artifact(ws, "pretrain", "5" * 16, {"job/metrics.jsonl": jsonl}, {}, tmp_path / "b")
    path2 = write_report(cfg, refs2)
    md2 = path2.read_text()
    assert re.search(r"\| loss \| 1 \| 9\.0000 \| 9\.0000 \|", md2)
    for section in ("Ablations: not run.", "Evaluation: not run.", "Serving: not run."):
        assert section in md2
    assert not (path2.parent / "ablations_plots_scaling_fit.png").exists()  # no stale picture

    refs3 = {k: first[k] for k in ("data",)}
    md3 = write_report(cfg, refs3).read_text()
    assert "Pretraining: not run." in md3 and "| tokens | not run |" in md3


def test_compare_two_real_lifecycle_runs(micro, monkeypatch, capsys):
    """The second run changed pretrain.seq_len: data and tokenizer were cache hits, tokens ran."""
    import mlflow

    from flows.compare import compare_command, compare_runs

    cfg, first, second, work = micro
    assert {s: r["cached"] for s, r in second.items()} == {"data": True, "tokenizer": True, "tokens": False}
    monkeypatch.setenv("EIGHTFOLD_WORKDIR", str(work))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = Workspace.from_config(cfg).tracking_uri
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("micro").experiment_id
    parents = client.search_runs([exp], "tags.kind = 'lifecycle'", order_by=["attributes.start_time ASC"])
    assert len(parents) == 2
    a, b = parents[0].info.run_id, parents[1].info.run_id
    comp = compare_runs(uri, a, b, "micro")
    assert comp.param_diff == {"pretrain.seq_len": ("64", "32")}
    assert set(comp.metrics) == set(STAGES)
    assert comp.b.stages["data"]["cached"] and comp.b.stages["data"]["run_id"] == comp.a.stages["data"]["run_id"]
    assert comp.a.stages["tokens"]["run_id"] != comp.b.stages["tokens"]["run_id"]
    # Each side's tokens figures are the ones its own run committed (the artifact's summary).
    for side, res in (("a", first), ("b", second)):
        expect = {k: float(v) for k, v in res["tokens"]["summary"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        got = {k: (va if side == "a" else vb) for k, (va, vb) in comp.metrics["tokens"].items()}
        assert expect and {k: got.get(k) for k in expect} == expect
    assert comp.metrics["tokens"]["seq_len"] == (64.0, 32.0)
    # And by Prefect flow-run id, through the command.
    flow_a = parents[0].data.tags["prefect.flow_run_id"]
    assert compare_command(flow_a, b, "micro", []) == 0
    assert "pretrain.seq_len" in capsys.readouterr().out
