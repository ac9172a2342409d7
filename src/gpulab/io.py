"""Writing files so that a crash never leaves half of one: write to a temporary name in the
same folder, fsync it, rename it into place, then fsync the folder. A reader sees the old
version or the new one, and after a power cut the new one is either whole on disk or not there
(without the first fsync a journalling file system may commit the rename before the data,
leaving an empty or short file under the final name; without the second, the rename itself may
be lost).

Used by every part of gpulab that writes results (run directories, profiles, benchmarks), so
it sits below them all and imports nothing of gpulab but errors.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from gpulab.errors import UserError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    try:
        _replace_with(path, data)
    except OSError as e:
        # Name the file being written, not its temporary (nor no file at all: a full disk's ENOSPC
        # from write() names none), so that a caller's one line can say which file failed.
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    fsync_dir(path.parent)


def _replace_with(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it to `path`; on any failure
    the temporary file is removed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable. Where folders cannot be opened or synced
    (some file systems, Windows), there is nothing more to do."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


class CannotWrite(UserError):
    """A result file could not be written: a full disk, a folder gone or made read-only. One line
    that names the file and the fix; the atomic writers left nothing of it."""

    def __init__(self, error: OSError, option: str = "--out"):
        self.path = error.filename
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free space or use {option} DIR"
        else:
            fix = f"use {option} DIR, a folder you can write to"
        super().__init__(f"cannot write {error.filename or 'the results'}: {error.strerror or error}; {fix}")


@contextmanager
def writing_results(option: str = "--out"):
    """Around the writes of a command's results: an OSError becomes CannotWrite (one line, exit 2)
    instead of a traceback. `option` is the command's option for the output folder."""
    try:
        yield
    except OSError as e:
        raise CannotWrite(e, option) from None


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


def git_commit() -> str | None:
    """The commit of the checkout gpulab runs from (read-only `git rev-parse`), with '+dirty' when
    tracked files have uncommitted changes, or None outside a checkout: every result file records
    it, so that a number can be traced to the code that measured it."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            # --no-optional-locks: never touch the index, even to refresh it
            ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # not a checkout (installed package) or no git
    return commit + ("+dirty" if dirty else "")


@contextmanager
def native_stderr_hidden():
    """fd 2 points at /dev/null for the block: C++ libraries under gpulab (kineto starting and
    stopping torch.profiler, c10's once-only warnings) write log lines straight to it, and they
    are not the user's stderr. Keep the block short: the script's own stderr is hidden too."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
