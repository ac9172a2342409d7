"""Writing files so that a crash never leaves half of one: write to a temporary name in the
same folder, fsync it, rename it into place, then fsync the folder. A reader sees the old
version or the new one, and after a power cut the new one is either whole on disk or not there
(without the first fsync a journalling file system may commit the rename before the data,
leaving an empty or short file under the final name; without the second, the rename itself may
be lost).

Used by every part of gpulab that writes results (run directories, profiles, benchmarks), so
it sits below them all and imports nothing of gpulab but errors.

`OutputFolder` is how a command writes its results into a folder the user gave (--out): it never
replaces a file gpulab did not write there. Each such folder holds a small record,
`.gpulab-outputs.json`, of the files gpulab wrote in it and their sha256; a name that exists
is gpulab's only when the record lists it with the hash it has now (a file the user edited or
put there is theirs). Anything else is refused in one line before the command's work starts,
unless the user passes --force; a folder in an output's place is refused even then, and a link
is replaced itself, never written through.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
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
    tmp = _staged(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _staged(path: Path, data: bytes) -> Path:
    """A temporary file beside `path` holding `data`, on disk (fsynced), for a rename into place;
    on any failure nothing is left of it."""
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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


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


def json_bytes(obj) -> bytes:
    """A result as gpulab writes its JSON files: indented, one final newline."""
    return (json.dumps(obj, indent=2) + "\n").encode()


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json_bytes(obj))


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
    if (refused := cannot_create_in(parent, a_folder=True)) is not None:
        raise UserError(f"{option} {out}: {not_writable(parent, refused, 'choose another directory')}")


def not_writable(folder: Path, error: OSError, fix: str) -> str:
    """Why nothing can be made in `folder`, and `fix` or what else to do: a full disk is no
    permission problem."""
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
        return f"{folder} is not writable; {fix}"
    return f"nothing can be made in {folder} ({error.strerror or error}): {remedy(error)} or {fix}"


def cannot_create_in(folder: Path, a_folder: bool = False) -> OSError | None:
    """Why a file (or, with `a_folder`, a folder) cannot be made in `folder`, or None. Tried, not
    asked of os.access, which says yes to root where making one fails all the same (/sys, /proc);
    the trial has a name of its own (O_EXCL) and is removed at once."""
    try:
        if a_folder:
            os.rmdir(tempfile.mkdtemp(prefix=".gpulab-trial-", dir=folder))
        else:
            fd, name = tempfile.mkstemp(prefix=".gpulab-trial-", dir=folder)
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        return e
    return None


def remedy(error: OSError) -> str:
    """What to do about a failed write, in a few words, by its cause."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space"
    if error.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):
        return f"move what is in the way ({error.filename or 'a folder where a file goes'}) aside"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the folder writable"
    return "fix what the error names"


def given_path(text: str | os.PathLike | None, option: str = "--out", what: str = "a folder") -> Path | None:
    """The path an option gave, or None when it was not given. An empty one (a shell variable that
    was never set) is an error: taken for the default, it would write where the user did not say."""
    if text is None:
        return None
    if not os.fspath(text).strip():
        raise UserError(f"{option} '': an empty path; give {what}")
    return Path(text)


OUTPUTS_RECORD = ".gpulab-outputs.json"
"""In each folder gpulab writes results into: the files it wrote there, by sha256."""
_RECORD_FORMAT = "gpulab outputs 1"
_HASH_CHUNK = 1 << 20
_RECORD_LIMIT = 1 << 20  # a few hundred bytes per file recorded


class OutputRefused(UserError):
    """A file gpulab was about to write is in the way and is not gpulab's to replace."""


@dataclass(frozen=True)
class OutputFolder:
    """A folder a command writes its results into, and what it may replace there.

    `label` is how messages name the folder ("--out prof"), `fix` what the user can do instead,
    `force_hint` how they allow replacing (None where they cannot). `real_folder`: a folder gpulab
    picks inside one the user named (a run's profile/): a link there is refused, not followed,
    since the user never chose where it points. A folder the user named may be a link: theirs."""

    path: Path
    label: str
    fix: str = "choose a new or empty folder"
    force: bool = False
    force_hint: str | None = "pass --force"
    real_folder: bool = False

    @classmethod
    def out(cls, path: Path, force: bool = False, option: str = "--out") -> "OutputFolder":
        """The folder of a command's `--out DIR`."""
        return cls(Path(path), f"{option} {path}", force=force)

    def check(self, names: Iterable[str]) -> None:
        """Refuse in one line, before any work: the folder itself when it is not one gpulab may
        write into, or any of `names` (or the record) that exists and is not gpulab's to replace -
        and a name that is the record's own: the result would be written over by the record."""
        if OUTPUTS_RECORD in names:
            raise OutputRefused(f"{self.label}: {OUTPUTS_RECORD} is the name of gpulab's record of what it wrote "
                                f"there, never a result's; {self.fix}")
        if not self._folder_exists():
            return  # created by the write: nothing in it to replace
        record = self._record()
        for name in [*names, OUTPUTS_RECORD]:
            self._check_name(name, record)

    def write(self, files: dict[str, bytes], together: bool = False) -> None:
        """Write `files` (name -> content), each atomically, and record them as gpulab's.
        `together`: all or none, every file staged on disk before any is renamed into place (a
        model beside the numbers of another would mislead). Raises OutputRefused, or OSError with
        no file half-written."""
        self.check(files)  # again: the folder may have changed while the command worked
        self.path.mkdir(parents=True, exist_ok=True)
        recorded = self._record() or {}  # a foreign record, replaced under --force
        hashes = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        staged = _stage_all(self.path, files) if together else {}
        try:
            # Listed before they are written, old hashes kept: whatever a crash leaves in place,
            # the old file or the new one, a later run still knows as gpulab's.
            self._write_record({**recorded, **{n: sorted({*recorded.get(n, []), h}) for n, h in hashes.items()}})
            if together:
                _rename_all(staged, self.path)
            else:
                for name, data in files.items():
                    atomic_write_bytes(self.path / name, data)
        finally:
            for tmp in staged.values():
                tmp.unlink(missing_ok=True)
        self._write_record({**recorded, **{n: [h] for n, h in hashes.items()}})

    def remove_own(self) -> None:
        """Remove what gpulab wrote here, as recorded and unchanged since, then the record, then the
        folder if nothing else is left; anything else stays, and a link is never followed."""
        try:
            if not stat.S_ISDIR(os.lstat(self.path).st_mode):
                return
        except OSError:
            return
        recorded = self._record()
        if recorded is None:  # not gpulab's record: nothing here is known to be gpulab's
            return
        for name, hashes in recorded.items():
            # The record may come from elsewhere: a name that leads out of the folder is not one gpulab wrote
            plain = name == Path(name).name and name not in ("", ".", "..")
            if plain and _sha256_of(self.path / name) in hashes:
                (self.path / name).unlink()
        (self.path / OUTPUTS_RECORD).unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:  # something else is there: kept
            pass

    def _folder_exists(self) -> bool:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return False
        except OSError as e:
            raise OutputRefused(f"{self.label}: {e.strerror or e}; {self.fix}") from None
        if stat.S_ISLNK(mode):
            if self.real_folder:
                raise OutputRefused(f"{self.label} is a link, and gpulab writes there only into a real folder, "
                                    f"never through a link: remove the link")
            if not self.path.is_dir():
                raise OutputRefused(f"{self.label} is a link to nothing (or a loop of links): {self.fix}")
        elif not stat.S_ISDIR(mode):
            raise OutputRefused(f"{self.label} is not a folder: {self.fix}")
        return True

    def _check_name(self, name: str, recorded: dict[str, list[str]] | None) -> None:
        try:
            mode = os.lstat(self.path / name).st_mode
        except FileNotFoundError:
            return
        except OSError as e:
            raise OutputRefused(f"{self.label}: cannot look at {name} ({e.strerror or e}); {self.fix}") from None
        if stat.S_ISDIR(mode):  # os.replace cannot put a file there, and a folder is never gpulab's to empty
            raise OutputRefused(f"{self.label} holds {name}, a folder, where gpulab writes a file: {self.fix}")
        if self.force:
            return  # a link is replaced itself (os.replace), never what it points to
        if stat.S_ISLNK(mode):
            self._refuse(name, "a link gpulab did not make", "replace the link (what it points to stays)")
        elif not stat.S_ISREG(mode):
            self._refuse(name, "not a regular file", "replace it")
        elif name == OUTPUTS_RECORD:
            if recorded is None:
                self._refuse(name, "which gpulab did not write", "replace it")
        elif _sha256_of(self.path / name) not in (recorded or {}).get(name, []):
            self._refuse(name, "which gpulab did not write", "replace it")

    def _refuse(self, name: str, what: str, forcing: str) -> None:
        force = f", or {self.force_hint} to {forcing}" if self.force_hint else ""
        raise OutputRefused(f"{self.label} holds {name}, {what}: {self.fix}{force}")

    def _record(self) -> dict[str, list[str]] | None:
        """The files gpulab recorded here (name -> hashes); {} when there is no record, None when
        the file in its place is not gpulab's record."""
        try:
            text = read_regular_file(self.path / OUTPUTS_RECORD, _RECORD_LIMIT)
        except FileNotFoundError:
            return {}
        except OSError:
            return None
        try:
            record = json.loads(text)
        except ValueError:
            return None
        files = record.get("files") if isinstance(record, dict) and record.get("format") == _RECORD_FORMAT else None
        if not isinstance(files, dict) or not all(isinstance(h, list) for h in files.values()):
            return None
        return files

    def _write_record(self, files: dict[str, list[str]]) -> None:
        atomic_write_bytes(self.path / OUTPUTS_RECORD, json_bytes({"format": _RECORD_FORMAT, "files": files}))


def _sha256_of(path: Path) -> str | None:
    """The sha256 of a regular file's content; None for anything else (never read through a link,
    nor waited on) or one that cannot be read."""
    digest = hashlib.sha256()
    try:
        with open_regular_file(path) as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _stage_all(folder: Path, files: dict[str, bytes]) -> dict[str, Path]:
    """Every file's content in a temporary file beside its name, on disk; on a failure none is left
    and the error names the file that failed."""
    staged: dict[str, Path] = {}
    try:
        for name, data in files.items():
            try:
                staged[name] = _staged(folder / name, data)
            except OSError as e:
                raise OSError(e.errno, e.strerror or str(e), str(folder / name)) from e
    except BaseException:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        raise
    return staged


def _rename_all(staged: dict[str, Path], folder: Path) -> None:
    """Rename each staged file into place (removing it from `staged`), then make the renames durable."""
    for name in list(staged):
        os.replace(staged[name], folder / name)
        del staged[name]
    fsync_dir(folder)


def cache_dir() -> Path:
    """gpulab's own cache folder: $XDG_CACHE_HOME/gpulab, by default ~/.cache/gpulab."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpulab"


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


class NotRegularFile(OSError):
    """A path that names something other than a regular file: `kind` says what."""

    def __init__(self, path: Path, kind: str):
        super().__init__(errno.EINVAL, f"a {kind}, not a regular file", str(path))
        self.kind = kind


def open_regular_file(path: Path, follow: bool = False):
    """`path` opened for reading (binary), which must be a regular file: what gpulab reads from a
    folder or a data set that came from elsewhere. Opened without waiting (opening a FIFO that
    has no writer waits forever) and, unless `follow`, without following a link (a run
    directory's files are never links: ELOOP); anything but a regular file is NotRegularFile."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(path, file_kind(mode))
    return os.fdopen(fd, "rb")


def file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for is_kind, name in kinds if is_kind(mode)), "special file")


def read_regular_file(path: Path, limit: int, follow: bool = False) -> bytes:
    """open_regular_file's bytes, at most `limit` of them: a larger file is an OSError, read no
    further than `limit` + 1 bytes."""
    with open_regular_file(path, follow) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data
