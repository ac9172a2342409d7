"""Decoded data, kept: the arrays of a data set's files, decoded once and saved in gpulab's cache
as .npy, so that a later run maps them instead of decompressing the files again (Fashion-MNIST's
gzip takes ~0.5 s to decode on one core; its .npy loads in milliseconds).

An entry is named by its source files' identity (path, size, modification time, inode): a file
replaced or edited is a new entry. Entries are gpulab's own files, written atomically; read back,
they are data still (allow_pickle=False) and their caller validates them as it validates the
decoded files. A cache that cannot be written (a read-only home) or an entry that cannot be read
costs nothing but the decoding. The KEPT most recently used entries stay; older ones go.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from pathlib import Path

import numpy as np

from gpulab.io import atomic_write_bytes

KEPT = 4


def entry_name(sources: dict[str, Path]) -> str:
    """The entry for these source files as they are now."""
    h = hashlib.sha256()
    for key in sorted(sources):
        path = Path(sources[key]).resolve()
        st = path.stat()
        h.update(f"{key}={path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino};".encode())
    return h.hexdigest()[:20]


def read(folder: Path, sources: dict[str, Path]) -> dict[str, np.ndarray] | None:
    """The arrays saved for `sources` (one per key), or None when there is no usable entry."""
    entry = folder / entry_name(sources)
    if entry.is_symlink():
        return None  # not a folder gpulab made
    try:
        arrays = {key: np.load(entry / f"{key}.npy", mmap_mode="r", allow_pickle=False) for key in sources}
        os.utime(entry)  # recently used: kept
    except (OSError, ValueError):
        return None
    return arrays


def write(folder: Path, sources: dict[str, Path], arrays: dict[str, np.ndarray]) -> None:
    """Save `arrays` as the entry for `sources`, then let the oldest entries beyond KEPT go."""
    entry = folder / entry_name(sources)
    if entry.is_symlink():
        return  # never write through a link
    try:
        entry.mkdir(parents=True, exist_ok=True)
        for key, array in arrays.items():
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
            atomic_write_bytes(entry / f"{key}.npy", buf.getvalue())
    except OSError:
        return  # decoding again next time is the only cost
    evict(folder)


def evict(folder: Path) -> None:
    entries = sorted((p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEPT:]:
        shutil.rmtree(old, ignore_errors=True)
