"""Reading a sharded checkpoint (a torch.distributed.checkpoint folder) without running code from it.

torch's FileSystemReader unpickles a folder's `.metadata` as it is, and its default load planner
reads every value that is not a tensor (an optimizer's learning rate, its parameter names) with
torch.load's full unpickler: a folder made elsewhere could name any callable,
and loading it would call it. gpulab reads both through allow-lists instead - the metadata with
an unpickler that builds only DCP's own metadata records and torch's sizes, dtypes and layouts,
the values with `torch.load(weights_only=True)` - so what gpulab saved loads as it is, and a
folder that needs anything else is refused in one line. A user who trusts the folder says so
(`trust=True`, the commands' --trust-checkpoint), and torch's own reader reads it.

torch.distributed.checkpoint takes ~0.5 s to import: it is imported here, where a sharded
checkpoint is read, not when gpulab starts.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from pathlib import Path

import torch

from gpulab.errors import UserError
from gpulab.io import open_regular_file, read_regular_file

METADATA_MAX_BYTES = 1 << 28  # a model of millions of tensors has a few MiB of metadata

_DCP_RECORDS = ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
                "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
SAFE_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_RECORDS),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided): a dict lookup
    ("pathlib", "PosixPath"),  # the checkpoint's id, a path
    ("collections", "OrderedDict"),
}
"""What a `.metadata` file written by torch.distributed.checkpoint holds, besides torch's dtypes:
records of plain values, never a callable that does anything."""

SHARD_FILE = re.compile(r"[\w.-]+\.distcp")
"""What torch.distributed.checkpoint names a shard file (__0_0.distcp): a name in the folder, no path."""

TRUST_HINT = "if you made it or trust who did, pass --trust-checkpoint to read it with torch's own reader"


class NotSafe(pickle.UnpicklingError):
    """The file names something outside the allow-list."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in SAFE_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise NotSafe(f"{module}.{name}")


def read_shards(state: dict, folder: Path, trust: bool = False, **load_options) -> None:
    """dcp.load(state, folder), filling `state`'s tensors in place; `load_options`: dcp.load's
    own (a process group, or no_dist=True for one process). Untrusted, every byte read goes
    through the allow-lists above; a folder that needs more is one UserError."""
    import torch.distributed.checkpoint as dcp

    if trust:
        reader, planner = dcp.FileSystemReader(str(folder)), None
    else:
        # The metadata first, before DCP runs: DCP would log a refusal's traceback and go on to
        # look for another metadata file.
        try:
            metadata = read_metadata(folder)
        except pickle.UnpicklingError as e:
            raise _not_safe(folder, e) from None
        except OSError as e:
            raise UserError(f"{folder}: cannot read its .metadata ({e.strerror or e}); the sharded checkpoint is "
                            "incomplete") from None
        reader, planner = _reader_with(folder, metadata), _allow_listed_planner()
    try:
        with warnings.catch_warnings():  # "... assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=planner, **load_options)
    except (Exception, dcp.api.CheckpointException):  # DCP's own is a BaseException
        # DCP folds the planner's exception into one of its own: a refusal is found where it was recorded.
        refused = getattr(planner, "refused", None)
        if refused is not None:
            raise _not_safe(folder, refused) from None
        raise


def read_metadata(folder: Path):
    """A folder's `.metadata`, built with the allow-list only (NotSafe otherwise)."""
    import torch.distributed.checkpoint as dcp

    data = read_regular_file(folder / ".metadata", METADATA_MAX_BYTES)
    metadata = MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, dcp.metadata.Metadata):
        raise pickle.UnpicklingError("not DCP metadata")
    check_storage(folder, metadata)
    return metadata


def check_storage(folder: Path, metadata) -> None:
    """Every piece the metadata points at lies inside one of the folder's own shard files: read
    as it is, a path could lead anywhere (/dev/zero, another user's file) and a length be
    anything."""
    sizes: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name, offset, length = (getattr(info, key, None) for key in ("relative_path", "offset", "length"))
        if not (isinstance(name, str) and SHARD_FILE.fullmatch(name)):
            raise UserError(f"{folder}: its .metadata points at {str(name)[:80]!r}, not one of the folder's own shard "
                            "files (*.distcp): it was altered; the checkpoint is not read")
        if name not in sizes:
            try:
                sizes[name] = read_size(folder / name)
            except OSError as e:
                raise UserError(f"{folder}: cannot read its shard file {name} ({e.strerror or e}); the sharded "
                                "checkpoint is incomplete") from None
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= sizes[name]):
            raise UserError(f"{folder}: its .metadata points past the end of {name}: it was altered or the file is "
                            "truncated; the checkpoint is not read")


def read_size(path: Path) -> int:
    """The size of a regular file (never through a link)."""
    with open_regular_file(path) as f:
        return os.fstat(f.fileno()).st_size


def _not_safe(folder: Path, error: Exception) -> UserError:
    what = f"it names {error}" if isinstance(error, NotSafe) else "it holds more than tensors and plain values"
    return UserError(f"{folder}: this sharded checkpoint cannot be read safely ({what}, which gpulab never saves; "
                     f"reading it would run code it names): {TRUST_HINT}")


def _reader_with(folder: Path, metadata):
    """torch's reader of `folder`, handed the metadata already read."""
    import torch.distributed.checkpoint as dcp

    class CheckedMetadataReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp.metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedMetadataReader(str(folder))


def _allow_listed_planner():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class AllowListedPlanner(DefaultLoadPlanner):
        refused: pickle.UnpicklingError | None = None

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            # The stored value read with the allow-list, then handed to torch's planner as bytes
            # gpulab wrote itself from what was allowed: the planner's own torch.load then
            # unpickles nothing from the folder.
            try:
                allowed = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                self.refused = e
                raise
            checked = io.BytesIO()
            torch.save(allowed, checked)
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return AllowListedPlanner()
