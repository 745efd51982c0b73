"""trainer/audit.py in a process of its own (an audit hook cannot be removed): files opened for writing
and rename targets are recorded once each, reads are not, and devices (/dev/null) are never paths."""

import json
import subprocess
import sys
import textwrap


def test_audit_records_written_files_not_reads_or_devices(tmp_path):
    audit, data = tmp_path / "audit", tmp_path / "node0"
    data.mkdir()
    script = textwrap.dedent(f"""
        import os, subprocess
        from trainer import audit
        audit.install()
        for _ in range(2):
            open({str(data / 'a.txt')!r}, "w").write("x")
        open({str(data / 'a.txt')!r}).read()
        os.replace({str(data / 'a.txt')!r}, {str(data / 'b.txt')!r})
        open(os.devnull, "w").write("x")
        subprocess.run(["true"], stdout=subprocess.DEVNULL)
    """)
    env = {"EIGHTFOLD_AUDIT_WRITES": str(audit), "EIGHTFOLD_NODE_DIR": str(data), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    recs = [json.loads(line) for f in audit.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert [r["path"] for r in recs] == [str(data / "a.txt"), str(data / "b.txt")]
    assert {r["node"] for r in recs} == {str(data)}
