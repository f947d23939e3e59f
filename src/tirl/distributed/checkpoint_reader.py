"""Reading a torch.distributed.checkpoint (DCP) directory without running code from it.

DCP's own reader unpickles `.metadata` with `pickle.load` and every non-tensor entry (the optimizer's
hyperparameters) with `torch.load(weights_only=False)`: resuming from a checkpoint someone shared would
run whatever its pickles name. Here the metadata is unpickled with only DCP's own metadata classes,
`torch.Size`, dtypes and paths allowed (pickle's documented "restricting globals"), every non-tensor
entry with `torch.load(weights_only=True)` (tensors and plain values only), and each file the metadata
names must be a plain file name inside the checkpoint directory. Tensor data DCP already reads with
`weights_only=True`. Anything else is a `CheckpointRefused` line, before any of it is used.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tirl.config import ConfigError

_METADATA = "torch.distributed.checkpoint.metadata"
# Everything a DCP `.metadata` of torch 2.x names (checked against the files tirl writes).
ALLOWED_GLOBALS = frozenset(
    {
        (_METADATA, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class CheckpointRefused(ConfigError):
    """A checkpoint file that loading would have to trust: it names code or files outside itself (a
    ConfigError, so every command that resumes prints it as its one error line)."""


def _allowed(module: str, name: str) -> bool:
    return (module, name) in ALLOWED_GLOBALS or (
        module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointRefused(f"it names {module}.{name}, which is not checkpoint metadata")
        return super().find_class(module, name)


def read_metadata(stream, where: str) -> Metadata:
    """A `.metadata` file's Metadata, unpickled with only the allowed globals, its file names checked."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except CheckpointRefused as e:
        raise CheckpointRefused(f"{where}: refused: {e}") from None
    except Exception as e:  # a truncated or foreign file: what pickle says, in one line
        raise CheckpointRefused(f"{where}: not a checkpoint's metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointRefused(f"{where}: not a checkpoint's metadata (a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        path = str(getattr(info, "relative_path", ""))
        if not _SHARD_FILE.match(path) or getattr(info, "transform_descriptors", None):
            raise CheckpointRefused(f"{where}: refused: it points at {path!r}, not a shard file beside it")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader with the metadata read by `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_metadata(f, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_plain(value: io.BytesIO, fqn: str) -> Any:
    """A non-tensor checkpoint entry: tensors and plain values only."""
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(f"checkpoint entry {fqn}: refused: {unsafe_reason(e)}") from None


def unsafe_reason(error: Exception) -> str:
    """What a weights_only load refused, in a few words (torch's message is a page of advice)."""
    named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    what = f"it names {named.group(1)}" if named else "it holds more than tensors and plain values"
    return f"{what}, which loading would have to run"


class _PlainBytes:
    """`load_bytes` through `load_plain` (DCP's planners call torch.load with weights_only=False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = load_plain(value, read_item.dest_index.fqn)
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[read_item.dest_index.fqn] = obj  # type: ignore[attr-defined]


class SafeLoadPlanner(_PlainBytes, DefaultLoadPlanner):
    """Loads into a given state dict (training resumes)."""


class SafeEmptyLoadPlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (inspection in one process)."""


def load_safely(state: dict, path, no_dist: bool = False) -> None:
    """`dcp.load` of `path` into `state` through the safe reader and planner (a collective unless
    `no_dist`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = SafeFileSystemReader(str(path))
    reader.read_metadata()  # refused here, in one line, rather than wrapped in DCP's per-rank report
    try:
        if no_dist and not state:  # rebuilt whole from the metadata, as DCP's own dcp_to_torch_save does
            _load_state_dict(state, storage_reader=reader, planner=SafeEmptyLoadPlanner(), no_dist=True)
        else:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointRefused)]
        if refused:
            raise refused[0] from None
        raise
