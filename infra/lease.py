"""A lease on a key of the object store: which flow run builds an artifact now.

Two flow runs that reach the same stage with the same fingerprint would build the same artifact into
the same staging folder and the same job output. The first takes the stage's lease; the other waits,
and once the artifact is committed it is a cache hit (tasks/stage.py). The lease is an object in the
store, so it holds across machines and workers with nothing else to run (no Redis, no shared disk).

A lease names its owner and an expiry; the holder renews it from a thread every `ttl_s / 3`, so one
whose process died stops renewing and a waiter takes the lease over once it expired. Every write is
conditional (`Store.put_if`: S3's If-None-Match / If-Match, a flock'd compare on file://), so of two
runs taking a free or expired lease at once exactly one wins. Expiry compares the holder's clock with
the waiter's: `ttl_s` must exceed the clock skew between machines (seconds under NTP).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from infra.store import Store

log = logging.getLogger(__name__)

TTL_S = 120.0


def lease_key(experiment: str, stage: str, fingerprint: str) -> str:
    """Outside the artifact's prefix, so deleting or listing an artifact never touches its lease."""
    return f"_leases/{experiment}/{stage}/{fingerprint}.json"


class StoreLease:
    def __init__(self, store: Store, key: str, ttl_s: float = TTL_S):
        self.store, self.key, self.ttl_s = store, key, ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lost = False  # another run took it over while held (this one stopped renewing for ttl_s)
        self._version: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self, released: bool = False) -> bytes:
        return json.dumps({"owner": self.owner, "expires_at": time.time() + self.ttl_s,
                           "released": released}).encode()

    def holder(self) -> dict | None:
        """Who holds it now (owner, expires_at), or None when it is free."""
        current = self.store.get_versioned(self.key)
        if current is None:
            return None
        held = json.loads(current[0])
        return None if held["released"] or held["expires_at"] < time.time() else held

    def try_acquire(self) -> bool:
        """Take the lease if it is free, released or expired; False when another owner holds it."""
        current = self.store.get_versioned(self.key)
        if current is None:
            version = self.store.put_if(self._record(), self.key, None)
        else:
            held = json.loads(current[0])
            if not held["released"] and held["expires_at"] >= time.time():
                return False
            version = self.store.put_if(self._record(), self.key, current[1])
        if version is None:  # another run took it between our read and our write
            return False
        self._version, self.lost = version, False
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name=f"lease-{self.key}", daemon=True)
        self._renewer.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    return
            except Exception as exc:  # noqa: BLE001 - a store hiccup: the next renewal may pass
                log.warning("lease %s: renewal failed: %s", self.key, exc)

    def renew(self) -> bool:
        """Push the expiry out by ttl_s; False (and `lost`) when another run took the lease over."""
        version = self.store.put_if(self._record(), self.key, self._version)
        if version is None:
            self.lost = True
            log.warning("lease %s: taken over by another run (not renewed for %.0f s)", self.key, self.ttl_s)
            return False
        self._version = version
        return True

    def release(self) -> None:
        """Mark it released (if it is still ours), so a waiter takes it at once."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self._version is not None and not self.lost:
            self.store.put_if(self._record(released=True), self.key, self._version)
        self._version = None
