"""The pre-flight health check: a healthy machine passes with its figures; a broken store, an
unreachable tracking server, a full disk or a slow device fail and are named."""

from __future__ import annotations

import json

import pytest

from infra.config import load_config
from infra.health import CHECKS, health_command, run_health
from infra.workspace import Workspace


def test_healthy_run_reports_figures(tmp_path, capsys):
    rc = health_command("tiny", [f"infra.workdir={tmp_path / 'wd'}", "infra.device=cpu"], as_json=True)
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["ok"] and report["failed"] == []
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(CHECKS)

    dev = checks["devices"]["figures"]
    assert dev["device"] == "cpu" and dev["cpu_cores"] >= 1 and dev["memory_gb"] > 0

    ar = checks["allreduce"]["figures"]
    assert ar["ranks"] == 2 and ar["backend"] == "gloo" and ar["correct"] is True
    assert ar["bytes"] == 8 << 20 and ar["time_s"] > 0
    # The ring's bus bandwidth from the raw time: 2(N-1)/N * bytes / time, N = 2.
    assert ar["busbw_gbps"] == pytest.approx(2 * (2 - 1) / 2 * ar["bytes"] / ar["time_s"] / 1e9)
    assert "busbw" in checks["allreduce"]["detail"]

    mm = checks["matmul"]["figures"]
    assert mm["dtype"] == "float32" and mm["flops"] == pytest.approx(2 * mm["n"] ** 3 / mm["time_s"])
    assert checks["disk"]["figures"]["free_gb"] > 0
    assert checks["store"]["figures"]["uri"] == f"file://{tmp_path / 'wd' / 'artifacts'}"
    assert checks["tracking"]["figures"]["experiment"] == "tiny"
    # The probe object was deleted again: the store holds nothing.
    assert not any((tmp_path / "wd" / "artifacts").rglob("*.bin"))


def _run(tmp_path, capsys, *overrides, checks=("disk", "store", "tracking")):
    rc = health_command("tiny", [f"infra.workdir={tmp_path / 'wd'}", *overrides], as_json=True, checks=list(checks))
    return rc, json.loads(capsys.readouterr().out)


def test_invalid_store_fails_and_is_named(tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder")  # a store root under a file cannot exist, even as root
    rc, report = _run(tmp_path, capsys, f"infra.store=file://{tmp_path / 'a-file' / 'store'}")
    assert rc == 1 and report["failed"] == ["store"]
    store = next(c for c in report["checks"] if c["name"] == "store")
    assert "a-file" in store["detail"]


def test_unreachable_tracking_fails_fast(tmp_path, capsys):
    rc, report = _run(tmp_path, capsys, "infra.tracking_uri=http://127.0.0.1:1")
    assert rc == 1 and report["failed"] == ["tracking"]
    tracking = next(c for c in report["checks"] if c["name"] == "tracking")
    assert "unreachable" in tracking["detail"] and tracking["seconds"] < 10


def test_failure_named_on_the_console(tmp_path, capsys):
    rc = health_command("tiny", [f"infra.workdir={tmp_path}", "infra.tracking_uri=http://127.0.0.1:1"], False, ["tracking"])
    out = capsys.readouterr().out
    assert rc == 1 and "health check failed: tracking" in out


def test_thresholds_fail_disk_and_matmul(tmp_path):
    cfg = load_config("tiny", [f"infra.workdir={tmp_path}", "infra.device=cpu"])
    ws = Workspace.from_config(cfg)
    report = run_health(cfg, ws, ["disk", "matmul"], min_free_gb=1e9, matmul_n=256, expected_peak_flops=1e18)
    assert report.failed == ["disk", "matmul"]
    assert "under the 1000000000.0 GB minimum" in report.get("disk").detail
    assert report.get("matmul").figures["fraction_of_peak"] < 0.25
    # The same device measured against a peak it reaches passes.
    report = run_health(cfg, ws, ["matmul"], matmul_n=256, expected_peak_flops=1.0)
    assert report.ok and report.get("matmul").figures["fraction_of_peak"] > 1


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert health_command("tiny", ["infra.device=tpu"], as_json=False) == 2
    assert "infra.device" in capsys.readouterr().out
    cfg = load_config("tiny", [f"infra.workdir={tmp_path}"])
    with pytest.raises(ValueError, match="unknown health check"):
        run_health(cfg, Workspace.from_config(cfg), ["gpu-fans"])


@pytest.mark.s3
def test_store_round_trip_on_s3(tmp_path, capsys, s3_endpoint):
    rc, report = _run(tmp_path, capsys, "infra.store=s3://health-check/lifecycle", f"infra.s3_endpoint_url={s3_endpoint}", checks=["store"])
    assert rc == 0, report
    store = report["checks"][0]
    assert store["figures"]["uri"] == "s3://health-check/lifecycle" and store["figures"]["bytes"] == 1 << 20
