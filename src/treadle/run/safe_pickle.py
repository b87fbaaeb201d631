"""Checkpoint metadata loaded as data: DCP's ``.metadata`` is a pickle, and `pickle.load` of a crafted one runs
any code it names. `load_metadata` unpickles it admitting only the classes that metadata is made of;
`SafeReader` is DCP's FileSystemReader reading its metadata that way, for resume, reshard and export.

NOTE [metadata as data]: the allowed globals are the dataclasses of `torch.distributed.checkpoint.metadata`
that describe tensors (Metadata, TensorStorageMetadata, TensorProperties, ChunkStorageMetadata, MetadataIndex,
StorageMeta, the memory-format enum) and DCP's per-file `_StorageInfo`; `torch.Size`, torch dtypes and layouts;
`pathlib` paths (DCP records the checkpoint id); and the plain containers. Everything else is refused before it is
resolved, so nothing it names is imported or called. BytesStorageMetadata is refused too: a treadle checkpoint
holds only tensors, and DCP loads a bytes entry with ``torch.load(weights_only=False)``, which would hand the
shard file the same power the metadata pickle had.
"""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .config import RunError

logger = logging.getLogger(__name__)

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # str -> a torch.layout, looked up in torch's own table
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}


_TORCH_NAMES = frozenset({"Size", *(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))})


class MetadataRefused(RunError):
    """A ``.metadata`` names a global outside NOTE [metadata as data]: not a DCP checkpoint's, refused."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _TORCH_NAMES:  # looked up in torch's own namespace, nothing imported
            return vars(torch)[name]
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise MetadataRefused(f"treadle.run: checkpoint metadata {self._path} refers to {module}.{name}, which DCP "
                              f"metadata never holds: refused unread (was the file replaced or crafted?); "
                              f"load only checkpoints a treadle run wrote")


def load_metadata(path: str | Path) -> Metadata:
    """The DCP Metadata in file `path` (a checkpoint's ``.metadata``), unpickled under NOTE [metadata as data].
    Raises MetadataRefused for a global outside the allowed set (nothing it names runs), RunError for a file
    that is missing, truncated or not DCP metadata."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except MetadataRefused:
        raise
    except OSError as exc:
        raise RunError(f"treadle.run: cannot read checkpoint metadata {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # EOFError, UnpicklingError, a dataclass's __setstate__ given junk, ...
        raise RunError(f"treadle.run: checkpoint metadata {path} is damaged (truncated or not DCP metadata: "
                       f"{type(exc).__name__}: {exc})") from None
    if not isinstance(md, Metadata):
        raise RunError(f"treadle.run: checkpoint metadata {path} holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeReader(FileSystemReader):
    """`torch.distributed.checkpoint.FileSystemReader` whose metadata is read by `load_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = load_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
