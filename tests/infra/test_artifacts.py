"""The artifact contract: stable fingerprints, manifest written last, manifest-less folders invisible,
downloads verified against the manifest, and the `eightfold artifacts` view."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.s3 import new_bucket_name

from infra.artifacts import MANIFEST, commit_artifact, find_artifact, fingerprint, latest_artifact, list_artifacts
from infra.artifacts_view import artifacts_command
from infra.config import load_config
from infra.store import ChecksumMismatch, FileStore, sha256_file
from infra.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore(tmp_path / "store")
    return request.getfixturevalue("s3_store")


def make_dir(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


# --- fingerprints --------------------------------------------------------------------------------

def test_fingerprint_is_stable_and_order_independent():
    a = fingerprint("tokenizer", {"vocab_size": 4096, "min_freq": 2}, {"data": "00aa", "extra": "11bb"})
    b = fingerprint("tokenizer", {"min_freq": 2, "vocab_size": 4096}, {"extra": "11bb", "data": "00aa"})
    assert a == b and len(a) == 16 and int(a, 16) >= 0


def test_fingerprint_is_the_same_in_another_process():
    code = ("from infra.artifacts import fingerprint; "
            "print(fingerprint('tokenizer', {'vocab_size': 4096, 'special': ['<s>', '</s>']}, {'data': 'ab'}))")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {fingerprint("tokenizer", {"special": ["<s>", "</s>"], "vocab_size": 4096}, {"data": "ab"})}


def test_fingerprint_changes_with_config_inputs_and_stage():
    cfg = load_config("tiny")
    base = fingerprint("pretrain", cfg.pretrain, {"tokens": "aaaa"})
    # a pydantic section hashes by its fields: the model and its dump give the same fingerprint
    assert base == fingerprint("pretrain", cfg.pretrain.model_dump(mode="json"), {"tokens": "aaaa"})
    changed_lr = load_config("tiny", ["pretrain.lr=1e-3"])
    assert fingerprint("pretrain", changed_lr.pretrain, {"tokens": "aaaa"}) != base
    assert fingerprint("pretrain", cfg.pretrain, {"tokens": "bbbb"}) != base  # upstream changed
    assert fingerprint("pretrain", cfg.pretrain, {"tokens": "aaaa", "init": "cccc"}) != base
    assert fingerprint("ablations", cfg.pretrain, {"tokens": "aaaa"}) != base
    # a change in another section leaves this stage's fingerprint alone
    other = load_config("tiny", ["data.dedup.threshold=0.5"])
    assert fingerprint("pretrain", other.pretrain, {"tokens": "aaaa"}) == base


# --- commit, find, list, download ------------------------------------------------------------------

def test_commit_find_and_download(store, tmp_path):
    files = {"model.bin": os.urandom(50_000), "sub/config.json": b'{"a": 1}', "notes.txt": b"hello"}
    src = make_dir(tmp_path / "out", files)
    fp = fingerprint("export", {"fmt": "hf"}, {"pretrain": "0123456789abcdef"})
    art = commit_artifact(store, "exp", "export", fp, src, config={"fmt": "hf"},
                          inputs={"pretrain": "0123456789abcdef"}, started_at=1.0, extra={"summary": {"loss": 2.5}})
    assert art.uri == store.url(f"exp/export/{fp}")
    # the manifest records each file's sha256 and size, computed here independently
    m = store.get_json(f"exp/export/{fp}/{MANIFEST}")
    assert m["files"] == {n: {"sha256": sha256_file(src / n), "size": len(d)} for n, d in files.items()}
    assert (m["stage"], m["fingerprint"], m["inputs"], m["config"]) == ("export", fp, {"pretrain": "0123456789abcdef"}, {"fmt": "hf"})
    assert m["summary"] == {"loss": 2.5} and m["started_at"] == 1.0 and m["finished_at"] >= m["started_at"]
    assert m["code_version"]

    found = find_artifact(store, "exp", "export", fp)
    assert found == art and found.manifest == m and found.size == sum(len(d) for d in files.values())
    assert find_artifact(store, "exp", "export", "ffffffffffffffff") is None

    local = found.download(tmp_path / "dl")
    assert {n: (local / n).read_bytes() for n in files} == files
    assert json.loads((local / MANIFEST).read_text()) == m


def test_download_catches_a_corrupted_file(store, tmp_path):
    src = make_dir(tmp_path / "out", {"a.bin": os.urandom(10_000), "b.bin": os.urandom(10_000)})
    art = commit_artifact(store, "exp", "data", "00000000000000aa", src, config={})
    key = art.key("b.bin")
    store.put_bytes(b"not the bytes the manifest describes", key)  # replaced behind the manifest's back
    with pytest.raises(ChecksumMismatch, match=art.files["b.bin"]["sha256"]):
        art.download(tmp_path / "dl")
    assert not (tmp_path / "dl" / "b.bin").exists()
    assert not (tmp_path / "dl" / MANIFEST).exists()  # an incomplete copy is never marked complete


def test_folder_without_manifest_is_invisible(store, tmp_path):
    src = make_dir(tmp_path / "out", {"w.bin": b"weights"})
    done = commit_artifact(store, "exp", "pretrain", "1111111111111111", src, config={})
    # a second attempt that died before its manifest: files present, manifest missing
    store.put_dir(src, "exp/pretrain/2222222222222222")
    store.put_bytes(b"{}", "exp/pretrain/2222222222222222/result.json")
    assert store.exists("exp/pretrain/2222222222222222")
    assert find_artifact(store, "exp", "pretrain", "2222222222222222") is None
    assert [a.fingerprint for a in list_artifacts(store)] == ["1111111111111111"]
    assert [a.fingerprint for a in list_artifacts(store, "exp", "pretrain")] == ["1111111111111111"]
    assert latest_artifact(store, "exp", "pretrain") == done

    # a manifest.json nested inside an artifact (a checkpoint's own) is not an artifact
    ckpt = make_dir(tmp_path / "ckpt", {"checkpoints/0123456789abcdef/manifest.json": b'{"step": 50}',
                                        "checkpoints/0123456789abcdef/shard0.bin": b"x"})
    commit_artifact(store, "exp", "posttrain/sft", "3333333333333333", ckpt, config={})
    assert sorted((a.stage, a.fingerprint) for a in list_artifacts(store, "exp")) == [
        ("posttrain/sft", "3333333333333333"), ("pretrain", "1111111111111111")]
    assert [a.stage for a in list_artifacts(store, "exp", "posttrain")] == ["posttrain/sft"]
    assert latest_artifact(store, "exp", "posttrain") is None  # exactly that stage only


def test_list_is_newest_first_and_recommit_replaces(store, tmp_path):
    src = make_dir(tmp_path / "out", {"f.txt": b"1"})
    fps = ["aaaaaaaaaaaaaaa1", "aaaaaaaaaaaaaaa2", "aaaaaaaaaaaaaaa3"]
    for fp in fps:
        commit_artifact(store, "exp", "data", fp, src, config={})
    commit_artifact(store, "other", "data", "bbbbbbbbbbbbbbbb", src, config={})
    assert [a.fingerprint for a in list_artifacts(store, "exp", "data")] == fps[::-1]
    assert {a.experiment for a in list_artifacts(store)} == {"exp", "other"}

    # a forced re-run commits the same fingerprint again: new content, new manifest, newest again
    src2 = make_dir(tmp_path / "out2", {"f.txt": b"2", "g.txt": b"3"})
    again = commit_artifact(store, "exp", "data", fps[0], src2, config={})
    assert [a.fingerprint for a in list_artifacts(store, "exp", "data")] == [fps[0], fps[2], fps[1]]
    assert set(find_artifact(store, "exp", "data", fps[0]).files) == {"f.txt", "g.txt"}
    assert (again.download(tmp_path / "dl") / "f.txt").read_bytes() == b"2"


def test_invalid_artifact_names_are_rejected(tmp_path):
    store = FileStore(tmp_path / "s")
    for exp, stage, fp in (("exp", "../up", "aa"), ("", "data", "aa"), ("exp", "data/", "aa")):
        with pytest.raises(Exception, match="invalid artifact"):
            find_artifact(store, exp, stage, fp)


# --- `eightfold artifacts` -----------------------------------------------------------------------

def commit_lineage(store, tmp_path: Path) -> dict[str, str]:
    src = make_dir(tmp_path / "payload", {"a.bin": b"a" * 1500, "b.bin": b"b" * 500})
    data = commit_artifact(store, "tiny", "data", fingerprint("data", {"x": 1}), src, config={"x": 1})
    tok_fp = fingerprint("tokenizer", {"v": 2}, {"data": data.fingerprint})
    tok = commit_artifact(store, "tiny", "tokenizer", tok_fp, src, config={"v": 2}, inputs={"data": data.fingerprint})
    store.put_bytes(b"x", "tiny/pretrain/4444444444444444/w.bin")  # uncommitted: must not show
    return {"data": data.fingerprint, "tokenizer": tok.fingerprint, "tok_uri": tok.uri}


def test_artifacts_command_json_and_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # a wide terminal: no cell is folded
    overrides = [f"infra.workdir={tmp_path / 'wd'}"]
    ws = Workspace.from_config(load_config("tiny", overrides))
    assert artifacts_command("tiny", overrides, None, True) == 0
    assert json.loads(capsys.readouterr().out) == []
    ids = commit_lineage(ws.store, tmp_path)

    assert artifacts_command("tiny", overrides, None, True) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["stage"], r["fingerprint"]) for r in rows] == [("tokenizer", ids["tokenizer"]), ("data", ids["data"])]
    tok = rows[0]
    assert tok["inputs"] == {"data": ids["data"]} and tok["uri"] == ids["tok_uri"]
    assert tok["size_bytes"] == 2000 and tok["files"] == 2 and tok["created"].endswith("+00:00")
    assert rows[0]["created_ts"] >= rows[1]["created_ts"]

    assert artifacts_command("tiny", overrides, "data", True) == 0
    assert [r["stage"] for r in json.loads(capsys.readouterr().out)] == ["data"]

    assert artifacts_command("tiny", overrides, None, False) == 0
    out = capsys.readouterr().out
    assert "2 artifact(s)" in out and ids["tokenizer"] in out and ids["data"] in out
    assert out.index(ids["tokenizer"]) < out.index(ids["data"])  # newest first
    assert f"data={ids['data']}" in out and "2.0 KB" in out and "4444444444444444" not in out

    assert artifacts_command("tiny", overrides, "serve", False) == 0
    assert "no committed artifacts of stage 'serve'" in capsys.readouterr().out


def test_artifacts_command_reads_an_s3_store(s3_endpoint, tmp_path, capsys):
    bucket = new_bucket_name()
    overrides = [f"infra.workdir={tmp_path / 'wd'}", f"infra.store=s3://{bucket}/lake",
                 f"infra.s3_endpoint_url={s3_endpoint}"]
    ws = Workspace.from_config(load_config("tiny", overrides))
    ids = commit_lineage(ws.store, tmp_path)
    assert artifacts_command("tiny", overrides, None, True) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["fingerprint"] for r in rows] == [ids["tokenizer"], ids["data"]]
    assert rows[0]["uri"] == f"s3://{bucket}/lake/tiny/tokenizer/{ids['tokenizer']}"
    ws.store.delete("")


def test_artifacts_command_bad_config_names_the_field(capsys):
    assert artifacts_command("tiny", ["infra.store=ftp://x"], None, True) == 2
    err = capsys.readouterr().err
    assert "infra.store" in err and "ftp://x" in err


def test_commit_takes_in_what_a_job_wrote_to_the_store(store, tmp_path):
    """A training job writes straight under the artifact's prefix; the commit describes those files by
    the store's size and sha256 (no download on S3), a local file of the same name wins, and a killed
    save's checkpoint folder (no manifest) is dropped first, at any depth."""
    import hashlib

    from trainer.checkpoint import drop_uncommitted

    prefix = "exp/pretrain/0123456789abcdef"
    store.put_bytes(b"shard", f"{prefix}/checkpoints/step_00000004/__0_0.distcp")
    store.put_bytes(b"{}", f"{prefix}/checkpoints/step_00000004/manifest.json")
    store.put_bytes(b"half", f"{prefix}/checkpoints/step_00000008/__0_0.distcp")  # killed before its manifest
    store.put_bytes(b"half", f"{prefix}/sft/checkpoints/step_00000002/__0_0.distcp")
    store.put_bytes(b'{"step": 1}\n', f"{prefix}/metrics.jsonl")
    store.put_bytes(b"old", f"{prefix}/summary.json")
    assert drop_uncommitted(store, prefix) == [f"{prefix}/checkpoints/step_00000008", f"{prefix}/sft/checkpoints/step_00000002"]

    local = make_dir(tmp_path / "local", {"summary.json": b"new"})
    only_local = commit_artifact(store, "exp", "pretrain", "0123456789abcdef", local, config={})
    assert sorted(only_local.files) == ["summary.json"]  # a stage that trains nothing: its folder only
    art = commit_artifact(store, "exp", "pretrain", "0123456789abcdef", local, config={}, with_store_files=True)
    assert sorted(art.files) == ["checkpoints/step_00000004/__0_0.distcp", "checkpoints/step_00000004/manifest.json",
                                 "metrics.jsonl", "summary.json"]
    assert art.files["metrics.jsonl"] == {"sha256": hashlib.sha256(b'{"step": 1}\n').hexdigest(), "size": 12}
    assert art.files["summary.json"]["sha256"] == hashlib.sha256(b"new").hexdigest()
    assert store.get_bytes(f"{prefix}/summary.json") == b"new"
    got = find_artifact(store, "exp", "pretrain", "0123456789abcdef").download(tmp_path / "copy")
    assert (got / "checkpoints" / "step_00000004" / "__0_0.distcp").read_bytes() == b"shard"
