"""Shared fixtures (small Fashion-MNIST-shaped datasets written as real IDX files) and CLI helpers."""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from gpulab.data.fashion_mnist import FILES
from gpulab.data.idx import write_idx


def make_idx_dataset(folder: Path, num_train: int = 512, num_test: int = 256, seed: int = 0) -> Path:
    """Write a learnable 10-class dataset in Fashion-MNIST's exact file format.

    Each class is a fixed random 28x28 pattern plus noise, so a model can learn it in a few
    steps and tests can check that training actually improves accuracy.
    """
    rng = np.random.default_rng(seed)
    prototypes = rng.integers(0, 256, size=(10, 28, 28))
    folder.mkdir(parents=True, exist_ok=True)
    for part, n in (("train", num_train), ("test", num_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        noise = rng.normal(0, 40, size=(n, 28, 28))
        images = np.clip(prototypes[labels] + noise, 0, 255).astype(np.uint8)
        write_idx(folder / (FILES[f"{part}_images"] + ".gz"), images)
        write_idx(folder / (FILES[f"{part}_labels"] + ".gz"), labels)
    return folder


@contextmanager
def one_thread():
    """Torch on one thread. With two cores, torch's OpenMP threads spin-wait for each other; when
    another torch process shares the machine (a second test run, a benchmark), a 1-second test
    then takes a minute. One thread costs little on the tests' tiny data and keeps time stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_torch_thread(request):
    """one_thread() around a test (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`);
    a test marked slow (real data) keeps every thread."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    with one_thread():
        yield


@pytest.fixture
def tiny_data(tmp_path, monkeypatch) -> Path:
    """A small IDX dataset, also set as $GPULAB_DATA so gpulab finds it first."""
    folder = make_idx_dataset(tmp_path / "fashion")
    monkeypatch.setenv("GPULAB_DATA", str(folder))
    return folder


@pytest.fixture
def make_dataset():
    """The dataset writer itself, for tests that need several or odd-sized datasets."""
    return make_idx_dataset


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`gpulab argv` in-process: its exit code, stdout and stderr (argparse's own usage errors exit
    via SystemExit). Output captured before the call is dropped."""
    from gpulab.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str, exit_code: int = 2) -> None:
    """A user error: the exit code, one line on stderr naming each fragment, no traceback."""
    assert code == exit_code, err
    assert err.startswith("gpulab: error: "), err
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def disk_full_for(monkeypatch, *names: str) -> None:
    """From here on, gpulab.io's atomic writer meets a full disk when it writes a file called one of
    `names`: ENOSPC once the data is in its temporary file, so the writer's own clean-up is what
    leaves nothing behind. Other files (and child processes) write as usual."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        written = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if any(written.startswith(f".{name}.") for name in names):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr("gpulab.io.os.fsync", fsync)
