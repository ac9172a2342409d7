"""gpulab.io: a file is replaced whole, and durably (fsynced before and after the rename)."""

from __future__ import annotations

import os
import stat

import pytest

from gpulab import io


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
