"""Reading IDX files (the format of MNIST and Fashion-MNIST), with validation.

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian uint32 per dimension, then the data. Fashion-MNIST ships
images as uint8 [N, 28, 28] (magic 0x00000803) and labels as uint8 [N] (0x00000801).
Anything else is reported as a one-line `UserError` naming the file and the problem.

The file may come from anywhere, so reading is bounded: the header is checked before any
data is read, and then no more data than the header declares (plus a little, to say how
much is left over) is read or decompressed: a gzip bomb or a huge declared shape costs
nothing. Only regular files are read: a FIFO or a device would block or never end.
"""

from __future__ import annotations

import gzip
import io
import math
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from gpulab.errors import UserError
from gpulab.io import NotRegularFile, open_regular_file

UINT8 = 0x08
# Far above any IDX dataset gpulab reads (Fashion-MNIST's largest file holds 47 MB), below what
# would exhaust a machine's memory: a header declaring more is damaged or hostile.
MAX_DATA_BYTES = 2**32
# Read past the declared data, to say how many bytes trail it (up to this many).
TRAILING_COUNTED = 2**20
CHUNK = 2**20


def read_idx(path: Path, expect_ndim: int) -> np.ndarray:
    """Read an uint8 IDX file (.gz or raw) into a numpy array, checking its header."""
    path = Path(path)
    try:
        with _open_idx(path) as f:
            shape = _read_header(f, path, expect_ndim)
            size = _declared_size(path, shape)
            data = _read_at_most(f, size + TRAILING_COUNTED + 1)
    # Before OSError: BadGzipFile (bad header, CRC mismatch) is a subclass of it. A damaged
    # deflate stream raises zlib.error, a truncated one EOFError.
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{path}: corrupted gzip data ({e}); delete it and fetch the dataset again") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e}); check the path or re-fetch the dataset") from None

    if len(data) != size:
        what = "truncated" if len(data) < size else "has trailing bytes"
        got = len(data) if len(data) <= size + TRAILING_COUNTED else f"more than {size + TRAILING_COUNTED}"
        raise UserError(f"{path}: {what}: header says {shape} = {size} bytes of data, file has {got}")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


@contextmanager
def _open_idx(path: Path) -> Iterator[io.BufferedIOBase]:
    """The file's (decompressed) bytes as a stream; only a regular file is opened for reading."""
    try:
        opened = open_regular_file(path, follow=True)  # the user named it: a link is theirs
    except NotRegularFile as e:
        raise UserError(f"{path}: cannot read a {e.kind}; point it at the IDX file itself (.gz or raw)") from None
    with opened as f:
        if f.peek(2)[:2] == b"\x1f\x8b":  # gzip magic: decide by content, not by file name
            with gzip.GzipFile(fileobj=f, mode="rb") as unzipped:
                yield unzipped
        else:
            yield f


def _read_header(f: io.BufferedIOBase, path: Path, expect_ndim: int) -> tuple[int, ...]:
    """The shape the header declares, after checking magic, type and number of dimensions."""
    magic = f.read(4)
    if len(magic) < 4:
        raise UserError(f"{path}: only {len(magic)} bytes, too short for an IDX header; the file is truncated")
    zero, dtype, ndim = struct.unpack(">HBB", magic)
    if zero != 0 or dtype != UINT8:
        raise UserError(
            f"{path}: bad magic number 0x{magic.hex()} (expected 0x000008{expect_ndim:02x}); not an uint8 IDX file"
        )
    if ndim != expect_ndim:
        raise UserError(f"{path}: has {ndim} dimensions, expected {expect_ndim}; wrong file for this slot?")
    dims = f.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise UserError(f"{path}: truncated header ({4 + len(dims)} bytes)")
    return struct.unpack(f">{ndim}I", dims)


def _declared_size(path: Path, shape: tuple[int, ...]) -> int:
    """The data's size in bytes, as the header says; refused when absurd, before anything is read."""
    size = math.prod(shape)  # Python ints: in int64, (2**31, 2**31, 4) overflows to 0 and matches an empty file
    if size > MAX_DATA_BYTES:
        raise UserError(
            f"{path}: header says {shape} = {size} bytes of data, more than gpulab reads from one IDX file "
            f"({MAX_DATA_BYTES // 2**30} GiB); the file is damaged or not a dataset"
        )
    return size


def _read_at_most(f: io.BufferedIOBase, limit: int) -> bytearray:
    """Up to `limit` bytes, in chunks: memory grows with the data really there, not with what the
    header claims (one read(limit) would allocate all of `limit` up front), and a gzip stream is
    never decompressed past `limit`."""
    data = bytearray()
    while len(data) < limit:
        chunk = f.read(min(CHUNK, limit - len(data)))
        if not chunk:
            break
        data += chunk
    return data


def write_idx(path: Path, array: np.ndarray, compress: bool | None = None) -> None:
    """Write an uint8 array as an IDX file (used by tests and tools to make small datasets)."""
    path = Path(path)
    array = np.ascontiguousarray(array, dtype=np.uint8)
    data = struct.pack(">HBB", 0, UINT8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data += array.tobytes()
    if compress if compress is not None else path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=1)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
