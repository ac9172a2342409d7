"""gpulab.io: a file is replaced whole, and durably (fsynced before and after the rename)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from gpulab import io
from gpulab.errors import UserError
from tests.conftest import disk_full_for


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else "?"
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(("fsync", kind, target))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(io.os, "fsync", fsync)
    monkeypatch.setattr(io.os, "replace", replace)
    target = tmp_path / "result.json"
    io.atomic_write_bytes(target, b"new")

    assert [e[:2] for e in events] == [("fsync", "file"), ("replace", events[1][1]), ("fsync", "dir")]
    assert events[0][2] == events[1][1]  # the temporary file itself was fsynced, before it was renamed
    assert events[1][2] == str(target)
    assert events[2][2] == str(tmp_path)
    assert target.read_bytes() == b"new"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        io.atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_failed_write_names_the_file_and_not_its_temporary(tmp_path, monkeypatch):
    """ENOSPC from write() or fsync() names no file; the error must, for the one line that says it."""
    target = tmp_path / "plan.png"
    disk_full_for(monkeypatch, "plan.png")
    with pytest.raises(OSError) as failed:
        io.atomic_write_bytes(target, b"png")
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(target)
    assert str(io.CannotWrite(failed.value)) == f"cannot write {target}: No space left on device; free space or use --out DIR"
    assert list(tmp_path.iterdir()) == []


def test_git_commit_names_this_checkout_and_marks_a_dirty_one(tmp_path, monkeypatch):
    import re
    import subprocess

    root = Path(io.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    commit = io.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit) and commit.startswith(head)
    real_run = subprocess.run

    def run(cmd, **kwargs):  # `git status` lists a changed tracked file
        done = real_run(cmd, **kwargs)
        if "status" in cmd:
            done = subprocess.CompletedProcess(cmd, 0, stdout=" M src/gpulab/io.py\n", stderr="")
        return done

    monkeypatch.setattr(io.subprocess, "run", run)
    assert io.git_commit() == head + "+dirty"


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "free space"), (errno.EISDIR, "move what is in the way (x) aside"),
                                         (errno.EACCES, "make the folder writable"), (errno.EIO, "fix what the error names")])
def test_a_failed_write_s_remedy_follows_its_cause(code, words):
    """A folder in metrics.json's place was told to "free space"."""
    assert io.remedy(OSError(code, os.strerror(code), "x")) == words


def test_a_trial_file_or_folder_says_where_nothing_can_be_made_and_leaves_nothing(tmp_path):
    assert io.cannot_create_in(tmp_path) is None and io.cannot_create_in(tmp_path, a_folder=True) is None
    assert list(tmp_path.iterdir()) == []
    assert isinstance(io.cannot_create_in(tmp_path / "gone"), FileNotFoundError)
    if os.path.isdir("/sys/kernel"):  # os.access says yes to root there
        assert io.cannot_create_in(Path("/sys/kernel")) is not None
        assert io.cannot_create_in(Path("/sys/kernel"), a_folder=True) is not None


def test_a_full_disk_is_said_as_a_full_disk_not_as_permissions(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io.tempfile, "mkdtemp", full)
    with pytest.raises(UserError) as refused:
        io.check_writable(tmp_path / "run")
    assert str(refused.value) == (f"--out {tmp_path / 'run'}: nothing can be made in {tmp_path} (No space left on "
                                  f"device): free space or choose another directory")
