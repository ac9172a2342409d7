"""The run directory: config.json, metrics.json/csv, curves.png, checkpoint.pt, and .gpulab.lock.

A run owns its directory for its whole life: it holds an exclusive lock (flock) on `.gpulab.lock`
inside it, so a second run into the same directory, or a --resume of it, is refused in one line
while the first one lives. The operating system drops the lock with the process however it ends
(kill -9 included), so a dead run never blocks the next one. The file stays: it marks the folder
as a gpulab run and says who holds it ("pid 123 on host").

A new run writes its directory only once it is known to start, everything built (`claim`). As
--out it takes a new path, an empty folder, or a gpulab run that has no checkpoint yet (it
stopped before its first epoch ended: killed, Ctrl-C, diverged, failed at its first step), which
is started over in place. It refuses a run that has a checkpoint (continue it with --resume) and
any other non-empty folder (never writing over the user's files). The default directory,
runs/<timestamp>-<model>, is created exclusively: runs started in the same second get -2, -3, ...

Every file is written atomically (gpulab.io), so a crash or Ctrl-C never leaves a half-written
file. Under torchrun only rank 0 writes here and holds the lock - except a sharded run's
(--shard fsdp) checkpoint: every rank writes its shard of each epoch into its own folder,
checkpoint-epoch<N>.dcp (torch.distributed.checkpoint), and checkpoint.pt, written by rank 0 once
every shard is there, names the folder. That small file is the commit: a run killed during a save
keeps the previous epoch's checkpoint.pt and folder; the folders it no longer names are removed.
A sharded checkpoint is read by every rank: the run directory must be on a filesystem every
machine of the job sees.
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import errno
import fcntl
import io
import json
import os
import pickle
import re
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpulab import models
from gpulab.config import TrainConfig
from gpulab.errors import UserError
from gpulab.io import (OutputFolder, atomic_write_bytes, atomic_write_json, check_writable as check_folder_writable, file_kind,
                       open_regular_file, read_regular_file)
from gpulab.parallel.shard_files import read_shards
from gpulab.train.background import Background
from gpulab.train.curves import Curves

CHECKPOINT = "checkpoint.pt"
SHARDS_GLOB = "checkpoint-epoch*.dcp"  # a sharded run's checkpoints (torch.distributed.checkpoint folders)
SHARDS_NAME = re.compile(r"checkpoint-epoch[0-9]+\.dcp")
LOCK = ".gpulab.lock"
RESULTS = ("metrics.json", "metrics.csv", "curves.png")
"""What a finished epoch writes besides the checkpoint: stale when a run starts over in place."""
RUN_FILES = ("config.json", CHECKPOINT, *RESULTS)
"""Every file a run writes in its folder (its lock apart)."""
PROFILE = "profile"  # where --profile writes its report, timeline and trace
CONFIG_MAX_BYTES = 1 << 20  # a run's config.json is under 1 KiB: anything near this is not one
METRICS_MAX_BYTES = 1 << 26  # ~1 KiB an epoch: 64 MiB is some 60,000 epochs

# The run directories claimed inside the innermost `claims()` block, released when it ends.
_claimed: contextvars.ContextVar[list | None] = contextvars.ContextVar("gpulab_claimed_run_dirs", default=None)


@dataclass(frozen=True)
class Trust:
    """What the user vouches for in a run directory they did not necessarily make: the model's
    import path (the same one its config.json names) and, for a sharded checkpoint that gpulab's
    allow-list refuses, reading it with torch's own reader (parallel/shard_files.py)."""

    model: str | None = None
    checkpoint: bool = False


def default_run_dir(model: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{model}"


def check_writable(run_dir: Path) -> None:
    """Fail before training if --out cannot be used: a path that cannot be created, a folder that
    is not a gpulab run, a run in use by another process or one with a checkpoint. Creates nothing."""
    check_folder_writable(run_dir)
    check_new_run(Path(run_dir))


def is_run(path: Path) -> bool:
    """A folder gpulab train made: its lock file (a regular file, never a link) beside a
    config.json that validates - or the lock alone, a run that stopped between claiming the folder
    and writing its config. Keys that look like a run's are not enough: a fine-tuning project's
    config.json may have them."""
    if not has_lock_file(path):
        return False
    if [p.name for p in path.iterdir()] == [LOCK]:
        return True
    try:
        parse_config(RunDir(path).read_config(), str(path))
    except UserError:
        return False
    return True


def has_lock_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path / LOCK).st_mode)
    except OSError:
        return False


def open_lock(path: Path, create: bool) -> int:
    """The lock file's descriptor. Never through a link, symbolic or hard (its target, or the file
    it shares, would be overwritten with "pid N on host"), never waiting on a FIFO; anything but a
    regular file of one name is an OSError."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fd = os.open(path / LOCK, flags, 0o644)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        linked = stat.S_ISREG(st.st_mode)
        raise OSError(errno.ELOOP if linked else errno.EINVAL, "a hard link" if linked else "not a regular file",
                      str(path / LOCK))
    return fd


def not_a_lock(option: str, path: Path, error: OSError) -> UserError:
    what = "a link" if error.errno == errno.ELOOP else "not a regular file"
    return UserError(f"{option} {path}: its {LOCK} is {what}, not the lock file gpulab train makes: this folder was "
                     "not made by gpulab; choose another directory")


def parse_config(config: dict, label: str) -> TrainConfig:
    """A run's config.json as a checked TrainConfig (every field of its type and choices); its
    errors start with the run directory as its reader was given it (`label`)."""
    try:
        return TrainConfig.from_dict(config)
    except UserError as e:
        raise UserError(f"{label}: {e}") from None


def holder(path: Path) -> str | None:
    """Who holds `path`'s lock ("pid 123 on host"), or None when no live run does. Creates nothing."""
    try:
        fd = open_lock(path, create=False)
    except OSError:
        return None  # no lock file (or not one): no run holds the folder
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        who = os.pread(fd, 200, 0).decode(errors="replace").strip()
        return who or "another process"
    except OSError:
        return None  # a file system without locks: nothing to learn
    finally:
        os.close(fd)  # releases the probe's shared lock
    return None


def in_use(option: str, path: Path, who: str) -> UserError:
    if option == "--resume":
        return UserError(f"--resume {path}: in use by another gpulab run ({who}); wait for it to end, then resume")
    return UserError(f"--out {path} is in use by another gpulab run ({who}); wait for it to end or choose another --out")


def check_new_run(path: Path, locked: bool = False) -> None:
    """Whether a new run may use `path` (see the module's docstring); `locked`: we hold its lock."""
    if not path.is_dir():
        return  # created by the run (check_folder_writable said whether it can be)
    try:
        entries = sorted(p.name for p in path.iterdir())
    except OSError as e:
        raise UserError(f"--out {path}: cannot list it ({e.strerror or e}); choose another directory") from None
    if not entries:
        return
    if not is_run(path):
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise UserError(f"--out {path} is not empty and not a gpulab run (it holds {shown}): choose a new or empty folder")
    who = None if locked else holder(path)
    if who:
        raise in_use("--out", path, who)
    if (path / CHECKPOINT).exists():
        raise UserError(f"--out {path} already holds a gpulab run: continue it with --resume {path} or choose another --out")
    # A run that stopped before its first checkpoint: this one starts over in place.


@contextlib.contextmanager
def claims():
    """Release every run directory claimed inside the block when it ends (however it ends)."""
    token = _claimed.set([])
    try:
        yield
    finally:
        for run_dir in _claimed.get():
            run_dir.release()
        _claimed.reset(token)


def csv_row(row: dict) -> dict:
    """One metrics row as CSV cells: numbers stay numbers; a per-device list becomes one column
    per device (`allreduce_share_0`, ...), or a plain column with one device; nested tables
    (phases) are left to metrics.json."""
    cells = {}
    for key, value in row.items():
        if isinstance(value, dict):
            continue
        if isinstance(value, (list, tuple)):
            if len(value) == 1:
                cells[key] = value[0]
            else:
                cells.update({f"{key}_{i}": v for i, v in enumerate(value)})
        else:
            cells[key] = value
    return cells


class RunDir:
    def __init__(self, path: Path, unique: bool = False, option: str | None = None, trust: Trust = Trust()):
        self.path = Path(path)
        self.trust = trust
        """What the user vouches for in this directory (an existing run's, read)."""
        self.unique = unique
        """A default path: claimed under a name of its own (-2, -3, ... when taken)."""
        self.option = option
        """The command-line option that named this existing run ("--resume"), which the errors of
        reading it start with; None where the folder was named on its own (gpulab export DIR)."""
        self._lock: int | None = None
        self._curves: Curves | None = None
        self.writes = Background("gpulab-checkpoint")
        """An epoch's checkpoint and metrics being written while the next epoch trains (loop.py)."""

    @property
    def label(self) -> str:
        """The run directory as its reader's errors name it: "--resume DIR", or "DIR"."""
        return f"{self.option} {self.path}" if self.option else str(self.path)

    # ------------------------------------------------------------------ owning the directory

    def claim(self) -> None:
        """Make the directory this new run's own, creating it (once everything is built and the
        run is known to start). Checks again what the early check_writable said: the folder may
        have changed since."""
        if self.unique:
            self._create_unique()
        else:
            check_new_run(self.path)
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"--out {self.path}: cannot create it ({e.strerror or e}); choose another directory") from None
        self._take_lock("--out")
        check_new_run(self.path, locked=True)  # owned now: what is here stays as seen
        self.check_files_replaceable("--out")
        for name in RESULTS:  # a run started over in place: its predecessor's results are not this run's
            (self.path / name).unlink(missing_ok=True)
        OutputFolder(self.path / PROFILE, f"--out {self.path}: {PROFILE}").remove_own()  # ... nor its --profile report
        self.remove_shards_but(None)  # ... nor its unfinished sharded checkpoint

    def claim_for_resume(self) -> None:
        """Own an existing run's directory to continue it (after read_config)."""
        if not has_lock_file(self.path):
            what = f"its {LOCK} is not a regular file" if os.path.lexists(self.path / LOCK) else f"no {LOCK} there"
            raise UserError(f"{self.label}: {what}, so gpulab train did not make this folder and will not write into it; "
                            "give the directory of a run gpulab made")
        who = holder(self.path)
        if who:
            raise in_use("--resume", self.path, who)
        if not self.has_checkpoint():
            raise self._no_checkpoint()  # before writing anything here
        self.check_files_replaceable("--resume")
        self._take_lock("--resume")

    def check_files_replaceable(self, option: str) -> None:
        """Before a run writes its files: none of their names may be a folder here (a file is
        replaced, a link replaced itself; a folder would fail the run's first write after an epoch
        of training)."""
        for name in RUN_FILES:
            if (self.path / name).is_dir() and not (self.path / name).is_symlink():
                raise UserError(f"{option} {self.path}: {name} is a folder there, where the run writes a file; move it "
                                "away or choose another directory")

    def _create_unique(self) -> None:
        base = self.path
        for n in range(1, 1000):
            candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                candidate.mkdir(parents=True)
            except FileExistsError:
                continue
            except OSError as e:
                raise UserError(f"cannot create the run directory {candidate} ({e.strerror or e}): give --out DIR") from None
            self.path = candidate
            return
        raise UserError(f"{base}: 999 run directories of this name exist already; give --out DIR")

    def _take_lock(self, option: str) -> None:
        try:
            fd = open_lock(self.path, create=True)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EINVAL, errno.ENXIO):
                raise not_a_lock(option, self.path, e) from None
            raise UserError(f"{option} {self.path}: cannot write there ({e.strerror or e}); choose another directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise in_use(option, self.path, who) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            # A file system without locks (some network mounts): the run goes on unguarded.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._lock = fd
        claimed = _claimed.get()
        if claimed is not None:
            claimed.append(self)

    def release(self) -> None:
        """Give the directory up (the lock file stays, marking the folder as a gpulab run)."""
        if self._lock is not None:
            fd, self._lock = self._lock, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)  # also for copies of the fd in forked data-loader workers
            os.close(fd)

    def start(self, config: dict) -> str:
        """claim(), then write config.json: the new run's directory exists from here on. Returns its path."""
        self.claim()
        try:
            self.write_config(config)
        except OSError as e:
            raise UserError(f"--out {self.path}: cannot write config.json ({e.strerror or e}); choose another directory") from None
        return str(self.path)

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ files

    def write_config(self, config: dict) -> None:
        atomic_write_json(self.path / "config.json", config)

    def check_is_run(self) -> None:
        """Before reading a run: one line unless the folder is a gpulab run with a checkpoint."""
        if not self.path.exists():
            raise UserError(f"{self.label} does not exist; give the directory of a gpulab train run")
        if not self.path.is_dir():
            raise UserError(f"{self.label} is not a directory; give the directory of a gpulab train run")
        if not (self.path / "config.json").is_file():
            raise UserError(f"{self.label} is not a gpulab run directory (no config.json)")
        if not self.has_checkpoint():
            raise self._no_checkpoint()

    def read_config(self) -> dict:
        """config.json as it is on disk (a JSON object; parse_config checks its fields). Read as
        what it may be, a file from elsewhere: a regular file of bounded size, not a link."""
        try:
            text = read_regular_file(self.path / "config.json", CONFIG_MAX_BYTES).decode()
            config = json.loads(text)
        except OSError as e:
            what = "it is a link" if e.errno == errno.ELOOP else e.strerror or str(e)
            raise UserError(f"{self.label}: no readable config.json ({what}); is this a gpulab run directory?") from None
        except UnicodeDecodeError:
            raise UserError(f"{self.label}: config.json is not UTF-8 text; it is not a gpulab run config") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{self.label}: config.json is not valid JSON ({e}); is this a gpulab run directory?") from None
        except RecursionError:
            raise UserError(f"{self.label}: config.json is nested too deeply; it is not a gpulab run config") from None
        if not isinstance(config, dict):
            raise UserError(f"{self.label}: config.json is not a gpulab run config")
        return config

    def trusted_config(self) -> dict:
        """read_config(), refused when it names a model by import path other than the one the user
        gave on this command line (self.trust): importing a module runs its code, and a run
        directory may come from anyone."""
        config = self.read_config()
        saved, given = config.get("model"), self.trust.model
        if isinstance(saved, str) and models.is_factory(saved) and saved != given:
            raise UserError(f"{self.label}: its config.json names the model {saved}, code gpulab would import and run: "
                            f"if you trust it, say so with --model {saved}")
        if given is not None and saved != given:  # a built-in model other than the run's: not this run
            raise UserError(f"{self.label}: --model {given}, but this run trains {saved} (its config.json), and a "
                            f"run keeps its model: drop --model (a new run with --model {given} goes elsewhere, --out)")
        return config

    def write_metrics(self, history: list[dict], last: bool = True) -> None:
        """metrics.json and metrics.csv; curves.png after the run's last epoch (`last`, or a
        resume), and now and then before on a thread of its own (train/curves.py)."""
        atomic_write_json(self.path / "metrics.json", history)
        flat = [csv_row(row) for row in history]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for row in flat for k in row)))
        writer.writeheader()
        writer.writerows(flat)
        atomic_write_bytes(self.path / "metrics.csv", buf.getvalue().encode())
        self.curves.update(history, last)

    @property
    def curves(self) -> Curves:
        """curves.png of this run (once its folder is claimed: the path is final)."""
        if self._curves is None:
            self._curves = Curves(self.path, self._title)
        return self._curves

    def metrics_epochs(self) -> list | None:
        """The epochs metrics.json lists (None when it is missing or unreadable: read as a file from
        elsewhere, a regular file of bounded size, never a link or a FIFO)."""
        try:
            rows = json.loads(read_regular_file(self.path / "metrics.json", METRICS_MAX_BYTES))
            return [row["epoch"] for row in rows]
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def _title(self) -> str:
        """The run's folder, with its model and devices when config.json says them."""
        try:
            config = json.loads(read_regular_file(self.path / "config.json", CONFIG_MAX_BYTES))
            return f"{self.path.name}: {config['model']} on {config['devices']}"
        except (OSError, ValueError, TypeError, KeyError):
            return self.path.name

    def save_checkpoint(self, state: dict) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(self.path / CHECKPOINT, buf.getvalue())

    def shards_folder(self, epoch: int) -> Path:
        """Where every rank of a sharded run writes its shard of epoch `epoch`'s checkpoint."""
        return self.path / f"checkpoint-epoch{epoch}.dcp"

    def remove_shards_but(self, keep: str | None) -> None:
        """The sharded checkpoints checkpoint.pt no longer names (older epochs, a save cut short)."""
        for folder in self.path.glob(SHARDS_GLOB):
            if folder.name != keep:
                shutil.rmtree(folder, ignore_errors=True)

    def has_checkpoint(self) -> bool:
        return (self.path / CHECKPOINT).is_file()

    def _no_checkpoint(self) -> UserError:
        path = self.path / CHECKPOINT
        if os.path.lexists(path):  # something in its place that is no file
            mode = os.lstat(path).st_mode
            kind = "a link" if stat.S_ISLNK(mode) else f"a {file_kind(mode)}"
            return UserError(f"{self.label}: its {CHECKPOINT} is {kind}, not a file; a gpulab checkpoint is a regular "
                             "file: this folder was altered or is no gpulab run")
        who = holder(self.path)
        if who:  # still in its first epoch
            return UserError(f"{self.label}: no {CHECKPOINT} there yet; the run is still in its first epoch ({who}): "
                             "try again once it has finished one")
        message = f"{self.label}: no {CHECKPOINT} there; the run stopped before its first epoch ended"
        if self.option == "--resume":  # nothing to continue: say how to start over instead
            message += f": start it over with gpulab train --out {self.path} and its options"
        return UserError(message)

    def load_checkpoint(self) -> dict:
        path = self.path / CHECKPOINT
        if not path.is_file():
            raise self._no_checkpoint()
        try:
            f = open_regular_file(path)
        except OSError as e:
            raise UserError(f"{self.label}: cannot read {CHECKPOINT} ({e.strerror or e}); a gpulab checkpoint is a "
                            "regular file, never a link") from None
        try:
            with f:
                checkpoint = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            # weights_only: tensors and plain values only, as gpulab saves them. Anything else would
            # be built by calling what the file names - code from whoever made it.
            named = re.search(r"GLOBAL (\S+)", str(e))
            if not named:
                raise UserError(f"{self.label}: {CHECKPOINT} is unreadable (not a checkpoint torch wrote); it is "
                                "damaged") from None
            raise UserError(f"{self.label}: {CHECKPOINT} names {named.group(1)}, which gpulab never saves (it saves "
                            "tensors and plain values): it was made or altered elsewhere, and is not loaded - loading "
                            "it would run that code") from None
        except Exception as e:  # truncated or foreign file: torch raises several types, OSError among them
            raise UserError(f"{self.label}: {CHECKPOINT} is unreadable ({type(e).__name__}); it is damaged") from None
        if not _is_gpulab_checkpoint(checkpoint):
            raise UserError(f"{self.label}: {CHECKPOINT} is not a gpulab checkpoint (it was made or altered elsewhere)")
        self._check_shards_name(checkpoint["strategy"])
        return checkpoint

    def _check_shards_name(self, state) -> None:
        """A sharded run's checkpoint.pt names its folder of shards: one of this run's own, inside
        it, never a path that leads elsewhere ("../..") nor a link."""
        shards = state.get("shards") if isinstance(state, dict) else None
        if shards is None:
            return
        folder = self.path / str(shards)
        if not (isinstance(shards, str) and SHARDS_NAME.fullmatch(shards) and folder.is_dir()
                and not folder.is_symlink()):
            raise UserError(f"{self.label}: {CHECKPOINT} names the shards {str(shards)[:100]!r}, which is not one of "
                            "this run's checkpoint-epoch<N>.dcp folders: it was altered or the folder is gone")


def _is_gpulab_checkpoint(checkpoint) -> bool:
    """What gpulab saves: the strategy's state, the epochs done, and one row of plain values per
    epoch (metrics.json's), numbered 1 to that count."""
    if not isinstance(checkpoint, dict) or not {"strategy", "history", "epoch"} <= checkpoint.keys():
        return False
    epoch, history = checkpoint["epoch"], checkpoint["history"]
    if type(epoch) is not int or not isinstance(history, list) or len(history) != epoch:
        return False
    return all(isinstance(row, dict) and row.get("epoch") == i and type(row["epoch"]) is int and _plain(row)
               for i, row in enumerate(history, 1))


def _plain(value) -> bool:
    """JSON's values only (metrics.json is written from the history)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float))


def read_sharded_model(folder: Path, template: dict, trust: bool) -> dict:
    """A sharded checkpoint's model weights, whole, in this one process (no process group): the
    tensors of `template` (a model's state_dict) filled from the shards (`gpulab export`)."""
    state = {"model": template}
    read_shards(state, folder, trust, no_dist=True)
    return state["model"]
