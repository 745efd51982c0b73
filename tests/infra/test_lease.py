"""The stage lease (infra/lease.py) on file:// and on S3 (moto over HTTP, which honours If-None-Match
and If-Match as S3 does): conditional writes are atomic, one owner at a time, a released lease is free
at once, an expired one (its holder stopped renewing) is taken over and the old holder learns it lost
it; and two runs of the same stage on the same fingerprint build it once, the second a cache hit."""

from __future__ import annotations

import threading
import time

import pytest

import tasks.stage as stage_module
from infra.config import load_config
from infra.lease import StoreLease, lease_key
from infra.store import FileStore


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore(tmp_path / "store")
    return request.getfixturevalue("s3_store")


def test_conditional_writes_create_once_and_replace_only_the_version_read(store):
    first = store.put_if(b"a", "k/lease.json", None)
    assert first and store.put_if(b"b", "k/lease.json", None) is None  # exists: not created again
    data, version = store.get_versioned("k/lease.json")
    assert (data, version) == (b"a", first)
    second = store.put_if(b"c", "k/lease.json", version)
    assert second and second != first
    assert store.put_if(b"d", "k/lease.json", first) is None  # a stale version loses
    assert store.get_versioned("k/lease.json")[0] == b"c" and store.get_versioned("k/nothing") is None


def test_of_many_takers_exactly_one_wins(store):
    leases = [StoreLease(store, "race.json") for _ in range(8)]
    won: list[StoreLease] = []
    go = threading.Barrier(len(leases))

    def take(lease):
        go.wait()
        if lease.try_acquire():
            won.append(lease)

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert won[0].holder()["owner"] == won[0].owner
    won[0].release()
    assert won[0].holder() is None


def test_held_released_and_expired(store):
    a, b = StoreLease(store, "l.json", ttl_s=3.0), StoreLease(store, "l.json", ttl_s=3.0)
    assert a.try_acquire() and not b.try_acquire()
    time.sleep(4.0)  # past the ttl, but a renews every ttl/3 (2 s of slack for a slow renewal): still a's
    assert not b.try_acquire() and b.holder()["owner"] == a.owner
    a.release()
    assert b.try_acquire()  # released: free at once
    b._stop.set()  # b's process "dies": no more renewals, no release
    b._renewer.join()
    c = StoreLease(store, "l.json", ttl_s=3.0)
    assert not c.try_acquire()
    time.sleep(3.2)
    assert c.try_acquire() and c.holder()["owner"] == c.owner  # expired: taken over
    assert not b.renew() and b.lost  # the old holder, back, learns it lost the lease
    b.release()  # does not free c's lease
    assert c.holder()["owner"] == c.owner
    c.release()


def test_two_runs_of_one_stage_build_it_once(tmp_path, monkeypatch):
    cfg = load_config("micro", [f"infra.workdir={tmp_path / 'work'}",
                                f"infra.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    built = []

    def slow_commit_point(stage):  # runs after the stage, before its commit: hold the lease a while
        built.append(stage)
        time.sleep(2.0)

    monkeypatch.setattr(stage_module, "_maybe_inject_fault", slow_commit_point)
    monkeypatch.setattr(stage_module, "LEASE_POLL_S", 0.1)
    refs, logs = [], []

    def run():
        refs.append(stage_module.execute_stage(cfg, "data", {}, log=logs.append))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join()
    assert built == ["data"]  # the stage ran once
    assert sorted(r.cached for r in refs) == [False, True] and refs[0].uri == refs[1].uri
    assert any("is building this artifact" in line and "waiting for it" in line for line in logs), logs
    ws_store = FileStore(tmp_path / "work" / "artifacts")
    fp = refs[0].fingerprint
    assert StoreLease(ws_store, lease_key("micro", "data", fp)).holder() is None  # released
