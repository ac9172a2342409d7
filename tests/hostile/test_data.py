"""A data set from elsewhere is read within bounds and, when hostile, fails in one line.

Each test plants one hostile file where gpulab reads Fashion-MNIST and checks the one-line
error, plus the bound that must hold while it is read: memory far below what a gzip bomb
decompresses to, no wait on a FIFO, no reading of a device.
"""

from __future__ import annotations

import gzip
import os
import struct
import threading
import time
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpulab.data.fashion_mnist import FILES
from gpulab.data.idx import read_idx
from gpulab.errors import UserError
from tests.conftest import assert_one_line_error, run_cli, scaled

TRAIN = ["train", "--devices", "cpu", "--epochs", "1", "--batch-size", "32"]
MiB = 2**20


def zeros_gzip(decompressed: int, head: bytes = b"") -> bytes:
    """A gzip bomb: `head`, then `decompressed` zero bytes, at about 1/1000 of that on disk. Built
    as repeats of one 16 MiB member (a reader decompresses concatenated members as one stream) so
    it takes no time to make; a single member of zeros reads the same."""
    member = gzip.compress(bytes(16 * MiB), compresslevel=9)
    return gzip.compress(head) + member * (decompressed // (16 * MiB))


def idx_header(*shape: int) -> bytes:
    return bytes([0, 0, 0x08, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)


def with_peak_memory(fn):
    """fn()'s result, and the most memory Python held at once while it ran."""
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_gzip_bomb_fails_at_its_header(tiny_data, tmp_path, capsys):
    """256 MiB of zeros named as the training images: refused by its magic number after reading
    a few bytes, not after decompressing it all."""
    bomb = tiny_data / (FILES["train_images"] + ".gz")
    bomb.write_bytes(zeros_gzip(256 * MiB))
    info, peak = with_peak_memory(lambda: pytest.raises(UserError, read_idx, bomb, 3))
    assert "bad magic number 0x00000000" in str(info.value)
    assert peak < 16 * MiB, f"held {peak / MiB:.0f} MiB reading a bomb that fails at byte 4"
    code, _, err = run_cli([*TRAIN, "--data-dir", str(tiny_data), "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, str(bomb), "bad magic number 0x00000000")


def test_data_past_the_declared_size_is_not_decompressed(tmp_path):
    """A good header for 10 labels, then 256 MiB of zeros: read up to a little past the 10 bytes,
    and said to have trailing bytes."""
    path = tmp_path / (FILES["train_labels"] + ".gz")
    path.write_bytes(zeros_gzip(256 * MiB, head=idx_header(10) + bytes(10)))
    info, peak = with_peak_memory(lambda: pytest.raises(UserError, read_idx, path, 1))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "has trailing bytes: header says (10,) = 10 bytes of data, file has more than" in message
    assert peak < 16 * MiB, f"held {peak / MiB:.0f} MiB of a file whose header declares 10 bytes"


def test_a_shape_whose_size_overflows_int64(tiny_data, tmp_path, capsys):
    """(2**31, 2**31, 4) is 2**64 bytes: 0 in int64 arithmetic, which matched an empty file. Found
    through $GPULAB_DATA (the tiny_data fixture), no --data-dir."""
    path = tiny_data / (FILES["train_images"] + ".gz")
    path.write_bytes(gzip.compress(idx_header(2**31, 2**31, 4)))
    code, _, err = run_cli([*TRAIN, "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, str(path), "(2147483648, 2147483648, 4) = 18446744073709551616 bytes", "more than")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["FIFO", "character device"])
def test_a_fifo_or_device_as_a_data_file(tiny_data, tmp_path, capsys, kind):
    """A FIFO (no writer: opening it waits forever) or a device (/dev/null here: /dev/zero never
    ends, and a test reading it would not end either) in the images' place: refused at once, by
    what it is."""
    path = tiny_data / (FILES["train_images"] + ".gz")
    path.unlink()
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/null")
    t0 = time.monotonic()
    with releasing_readers_after(scaled(10), path):
        code, _, err = run_cli([*TRAIN, "--data-dir", str(tiny_data), "--out", str(tmp_path / "run")], capsys)
    assert time.monotonic() - t0 < scaled(10), "waited on the file"
    assert_one_line_error(code, err, str(path), f"cannot read a {kind}", "the IDX file itself")


@contextmanager
def releasing_readers_after(seconds: float, fifo: Path):
    """After `seconds`, open and close the FIFO's writing end again and again until the block
    ends: a reader stuck opening it then gets an empty file, and the test fails instead of
    hanging the suite."""
    done = threading.Event()

    def release():
        if done.wait(seconds):
            return
        while not done.wait(0.05):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: no one is reading it now
                pass

    watchdog = threading.Thread(target=release, daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()


def test_data_dir_naming_a_file(tiny_data, tmp_path, capsys):
    a_file = tiny_data / (FILES["train_images"] + ".gz")
    code, _, err = run_cli([*TRAIN, "--data-dir", str(a_file), "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, f"--data-dir {a_file} is a file, not a folder", "point it at the folder")
    assert not (tmp_path / "run").exists()
