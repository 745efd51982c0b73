"""Which files a rank writes, for the node-loss drill's `shared_paths` (infra/drill.py): a Python audit
hook (PEP 578) sees every file opened for writing and every rename's target, and appends one JSON line
per new path to a file of its own in the folder `EIGHTFOLD_AUDIT_WRITES` names. Writes from C++
(torch.save's zip writer) are not seen; every rank writes those into its node's folder. Off unless the
variable is set."""

from __future__ import annotations

import json
import os
import sys
import threading

AUDIT_ENV = "EIGHTFOLD_AUDIT_WRITES"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# devices and the kernel's views (/dev/null as a subprocess's output): every machine has its own, none is shared
_NOT_FILES = ("/dev/", "/proc/", "/sys/")


def _for_writing(mode, flags) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def install() -> None:
    folder = os.environ.get(AUDIT_ENV)
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    from infra.health import node_name
    from infra.launch.job import NODE_DIR_ENV

    node = os.environ.get(NODE_DIR_ENV) or node_name()  # the local launcher's simulated node, else the scheduler's
    out = open(os.path.join(folder, f"{os.path.basename(node)}-{os.getpid()}.jsonl"), "a", buffering=1)
    seen: set[str] = set()
    lock = threading.Lock()
    busy = threading.local()

    def hook(event: str, args) -> None:
        if event == "open":  # (path, mode, flags)
            if not _for_writing(args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None):
                return
            target = args[0]
        elif event == "os.rename":  # (src, dst, ...): os.replace too; the name a file is published under
            target = args[1]
        else:
            return
        if getattr(busy, "on", False) or not isinstance(target, (str, bytes)):
            return
        busy.on = True
        try:
            path = os.path.abspath(os.fsdecode(target))
            with lock:
                if path not in seen and not path.startswith(_NOT_FILES):
                    seen.add(path)
                    out.write(json.dumps({"node": node, "path": path}) + "\n")
        finally:
            busy.on = False

    sys.addaudithook(hook)
