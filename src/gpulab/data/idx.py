"""Reading IDX files (the format of MNIST and Fashion-MNIST), with validation.

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian uint32 per dimension, then the data. Fashion-MNIST ships
images as uint8 [N, 28, 28] (magic 0x00000803) and labels as uint8 [N] (0x00000801).
Anything else is reported as a one-line `UserError` naming the file and the problem.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from gpulab.errors import UserError

UINT8 = 0x08


def read_idx(path: Path, expect_ndim: int) -> np.ndarray:
    """Read an uint8 IDX file (.gz or raw) into a numpy array, checking its header."""
    path = Path(path)
    try:
        raw = _read_bytes(path)
    # Before OSError: BadGzipFile (bad header, CRC mismatch) is a subclass of it. A damaged
    # deflate stream raises zlib.error, a truncated one EOFError.
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{path}: corrupted gzip data ({e}); delete it and fetch the dataset again") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e}); check the path or re-fetch the dataset") from None

    if len(raw) < 4:
        raise UserError(f"{path}: only {len(raw)} bytes, too short for an IDX header; the file is truncated")
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != UINT8:
        raise UserError(
            f"{path}: bad magic number 0x{raw[:4].hex()} (expected 0x000008{expect_ndim:02x}); "
            "not an uint8 IDX file"
        )
    if ndim != expect_ndim:
        raise UserError(f"{path}: has {ndim} dimensions, expected {expect_ndim}; wrong file for this slot?")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UserError(f"{path}: truncated header ({len(raw)} bytes)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(shape, dtype=np.int64))
    got = len(raw) - header
    if got != expected:
        what = "truncated" if got < expected else "has trailing bytes"
        raise UserError(f"{path}: {what}: header says {shape} = {expected} bytes of data, file has {got}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(2)
    if head == b"\x1f\x8b":  # gzip magic: decide by content, not by file name
        with gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


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
