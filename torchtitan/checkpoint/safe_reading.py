"""Reading DCP checkpoints without unpickling arbitrary objects: the part of checkpointing that is security-critical.

A checkpoint may come from anywhere (a shared folder, a download), and Python's pickle runs whatever code a file
names. DCP pickles two things, and each is read here with a loader that can only build data:

- the ``.metadata`` file (what the checkpoint holds, and where) is read by :class:`SafeFileSystemReader` with an
  unpickler that accepts DCP's metadata classes (classes only, never a function of that module), ``torch.Size``,
  dtypes, layouts, paths and a few builtin containers, and refuses everything else;
- non-tensor entries (such as optimizer hyperparameters) are read by :class:`SafeLoadPlanner` with
  ``torch.load(weights_only=True)``, which builds only tensors and plain containers.

Tensor data is raw bytes laid out as the metadata says, and plain-data state is JSON (``codec.py``). Every load of a
checkpoint must pass both a :class:`SafeFileSystemReader` and a :class:`SafeLoadPlanner` to ``dcp.load``. This
module depends on torch and DCP only, so that it can be reviewed alone.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

METADATA_FILE = ".metadata"  # DCP's name for it; a checkpoint folder without one is incomplete

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # rebuilds torch.strided & co. from their names
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts DCP's metadata classes, torch.Size, dtypes, layouts and paths, and a few builtin containers only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata":
            found = super().find_class(module, name)
            if isinstance(found, type):  # its dataclasses and enums; never a function
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose ``.metadata`` is read with :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        with open(os.path.join(os.fspath(self.path), name), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        # What FileSystemReader.read_metadata does after unpickling: tag the metadata with this load's id.
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor entries (e.g. optimizer hyperparameters) are read with
    ``torch.load(weights_only=True)``, which only builds tensors and plain containers, never arbitrary objects."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        safe_value = torch.load(value, weights_only=True)
        # Hand the parent a re-serialisation of the already-vetted value, so that its (unrestricted) load only ever
        # sees bytes we produced; this keeps us off DCP's private planner fields.
        vetted = io.BytesIO()
        torch.save(safe_value, vetted)
        vetted.seek(0)
        super().load_bytes(read_item, vetted)
