"""Reading stored checkpoint files without unpickling objects: whoever can write the bucket must not be
able to run code on the nodes that load from it (a pickle names functions, and a full unpickle calls
them).

- `load_plain`: torch.load(weights_only=True) for our own files (RNG states): tensors,
  numbers, strings and containers are rebuilt, anything else is refused before it is built.
- `MetadataReader`: torch.distributed.checkpoint's reader, except that DCP's `.metadata` (a pickle of
  its Metadata dataclasses) is unpickled allowing only those classes, torch.Size, dtypes and paths.
- `WeightsOnlyLoadPlanner`: DCP's default planner, except that non-tensor entries (an optimizer's
  param_groups: lr, betas ...) load weights-only; torch's own planner loads them with weights_only=False.

`load_dcp` puts the two together. Each refusal is a `RefusedFile` that names the file (or entry) and
what it tried to build.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem


class RefusedFile(ValueError):
    """A stored file that holds more than plain data: not loaded."""


def load_plain(path: Path, name: str, hint: str = "tampered with?") -> Any:
    """torch.load(weights_only=True) of a stored file; `name` (e.g. its URI) and `hint` go into the error."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RefusedFile(f"{name}: refused to load: it holds more than tensors and plain containers "
                          f"({hint}): {weights_only_reason(exc)}") from exc


def weights_only_reason(exc: Exception) -> str:
    """The one line of torch's weights-only error that says what was refused (the rest of it advises
    loading the file unsafely)."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(" Please use", 1)[0].strip()
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# --- DCP -------------------------------------------------------------------------------------------
_PATHS = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}


def _allowed(module: str, name: str) -> bool:
    """What DCP's Metadata pickles: its own dataclasses and enum, _StorageInfo, torch.Size, dtypes,
    layouts (torch.serialization._get_layout, by name) and the checkpoint id (a path)."""
    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        return isinstance(obj, type) and obj.__module__ == module  # defined there, not imported
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return ((module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                               ("torch.serialization", "_get_layout")}
            or (module == "pathlib" and name in _PATHS))


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise RefusedFile(f"{self.name}: refused to load: DCP metadata that names {module}.{name}, "
                              f"which is not one of DCP's metadata classes (tampered with?)")
        return super().find_class(module, name)


class MetadataReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with the allowlist above. `uri` names the
    checkpoint in errors (the store's URI rather than the local copy)."""

    def __init__(self, path: str | Path, uri: str | None = None):
        super().__init__(str(path))
        self.uri = uri or str(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, f"{self.uri}/{Path(path).name}").load()
        if not isinstance(metadata, Metadata):
            raise RefusedFile(f"{self.uri}/{Path(path).name}: refused to load: not DCP Metadata "
                              f"but {type(metadata).__name__}")
        # As FileSystemReader.read_metadata does after its own (unrestricted) pickle.load.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner.load_bytes with weights_only=True (torch's passes False)."""

    def __init__(self, uri: str = "checkpoint", **kwargs: Any):
        super().__init__(**kwargs)
        self.uri = uri

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise RefusedFile(f"{self.uri}: refused to load entry {fqn!r}: it holds more than tensors and "
                              f"plain containers (tampered with?): {weights_only_reason(exc)}") from exc
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # as DefaultLoadPlanner does

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_dcp(state: dict[str, Any], folder: str | Path, uri: str, process_group=None) -> None:
    """dcp.load of `state` from `folder` through MetadataReader and WeightsOnlyLoadPlanner. A refusal
    raises RefusedFile (DCP would wrap it, and retry a refused .metadata as a rank-local one)."""
    reader = MetadataReader(folder, uri)
    reader.read_metadata()  # a refused .metadata raises here, on every rank alike
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(uri), process_group=process_group)
    except CheckpointException as exc:
        for failure, _ in exc.failures.values():
            if isinstance(failure, RefusedFile):
                raise failure from exc
        raise
