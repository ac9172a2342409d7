"""Writing files so that a crash never leaves half of one: write to a temporary name in the
same folder, then rename it into place. A reader sees the old version or the new one.

Used by every part of gpulab that writes results (run directories, profiles, benchmarks), so
it sits below them all and imports nothing of gpulab but errors.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from gpulab.errors import UserError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def check_writable(out: Path, option: str = "--out") -> None:
    """Fail before any work if the output folder `out` cannot be created, creating nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{option} {out} is a file: choose a directory path")
    parent = out
    while not parent.exists():
        parent = parent.parent
    # A file part-way up (--out some.file/run): os.access alone would pass it for root when the
    # file has an x bit, and mkdir would then fail with a traceback.
    if not parent.is_dir():
        raise UserError(f"{option} {out}: {parent} is a file, not a folder; choose another directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {out}: {parent} is not writable; choose another directory")
