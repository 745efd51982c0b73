"""The progress-bar convention (infra/progress.py) in a non-interactive run: stderr that is a log file
gets one redraw per interval, not one per update; TQDM_DISABLE=1 turns bars off; the trainer's bar is
the same bar."""

import os
import subprocess
import sys

import pytest
import tqdm.std

from fixtures.progress import final, renders
from infra.progress import MININTERVAL_S, progress_bar
from trainer.metrics import MetricsSink

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def stderr_of(capsys) -> str:
    """What went to sys.stderr: pytest's capture stream, which is no terminal, as a CI runner's or a
    Prefect worker's stderr."""
    assert not sys.stderr.isatty()
    return capsys.readouterr().err


def test_a_log_file_gets_a_redraw_per_interval_not_per_update(capsys, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tqdm.std, "time", clock)  # tqdm's clock (std.py: `from time import time`)
    updates, step_s = 1000, 0.02  # 1000 documents over 20 s of fake time
    with progress_bar(updates, "data quality", "doc") as bar:
        for _ in range(updates):
            clock.now += step_s
            bar.update()
    text = stderr_of(capsys)
    drawn = renders(text, "data quality")
    elapsed = updates * step_s
    # The opening line, at most one redraw per MININTERVAL_S, and the final count.
    assert 3 <= len(drawn) <= 2 + elapsed / MININTERVAL_S, [r.n for r in drawn]
    assert drawn[-1] == final(text, "data quality")
    assert (drawn[-1].n, drawn[-1].total, drawn[-1].unit, drawn[-1].percent) == ("1000", "1000", "doc", 100)
    assert all(r.unit == "doc" and r.total == "1000" for r in drawn)


def test_a_pass_shorter_than_the_interval_leaves_one_line(capsys, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    with progress_bar(50_000, "data normalize", "doc") as bar:
        for _ in range(50_000):
            clock.now += (MININTERVAL_S - 0.1) / 50_000
            bar.update()
    text = stderr_of(capsys)
    assert [r.n for r in renders(text, "data normalize")] == ["0", "50000"] and text.count("\n") == 1


def test_tqdm_disable_turns_every_bar_off():
    code = ("from infra.progress import progress_bar\n"
            "with progress_bar(3, 'ablations', 'proxy') as bar:\n"
            "    bar.update(3)\n")

    def run(**env):
        base = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
        out = subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": ROOT, **env}, cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stderr

    assert final(run(), "ablations").n == "3"
    assert run(TQDM_DISABLE="1") == ""


def test_the_trainer_bar_is_the_same_bar(capsys, tmp_path):
    sink = MetricsSink(tmp_path, None, None, total_steps=4, enabled=True)
    for step in range(1, 5):
        sink.log({"loss": 5.0 - step, "lr": 1e-3}, step)
        sink.advance()
    sink.close()
    got = final(stderr_of(capsys), "train")
    assert (got.n, got.total, got.unit) == ("4", "4", "step")
