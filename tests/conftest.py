"""Shared fixtures (small Fashion-MNIST-shaped datasets written as real IDX files), CLI helpers, and
the machine's measured slowness that the tests' timeouts scale with (`scaled`)."""

from __future__ import annotations

import errno
import functools
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from gpulab import models
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


# ----------------------------------------------------------------------------- side by side

# `make test` runs the suite in two parts (Makefile): first every test not marked `alone`, side by
# side (pytest-xdist, a worker per core and one more, whole modules per worker so that a module's
# shared runs are made once); then the `alone` ones, one after another with nothing beside them. The
# profiler's tests are `alone`: they measure the machine (a process beside the job is a finding -
# a shared CPU - and their planted causes are shares of a step's time). Except those whose
# findings do not depend on a quiet machine: a job's faults, hangs and out-of-memory (each a
# finding of share 1.0, ahead of anything a neighbour could add), memory sizes, compile events
# (timed against the script's own clock in the same run), counts of steps and of objects held.
MEASURE_THE_MACHINE = Path(__file__).parent / "monitor"
SHARE_THE_CORES = {"test_profile_faults.py", "test_memory.py", "test_compile_probe.py", "test_long_runs.py",
                   "test_profile_safety.py"}

if os.environ.get("PYTEST_XDIST_WORKER"):
    # A worker per core: each trains on one thread, and so does every process it starts (torch's
    # OpenMP threads spin-wait for a core another worker holds: see one_thread below).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# The longest modules first: pytest-xdist's loadscope hands modules to the workers in this order,
# and one of these started last is the tail of the run while the other worker idles.
LONGEST_FIRST = ("test_torchrun.py", "test_profile_faults.py", "test_distributed.py", "test_compile_probe.py")


def pytest_collection_modifyitems(config, items):
    def order(item) -> int:  # stable: each module stays whole
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=order)
    for item in items:
        shares = item.path.name in SHARE_THE_CORES or item.get_closest_marker("shares_the_cores")
        if item.path.is_relative_to(MEASURE_THE_MACHINE) and not shares:
            item.add_marker(pytest.mark.alone)


# ----------------------------------------------------------------------------- machine speed

# What `workload_seconds()` takes on the machine the tests' timeouts were set on: the project's
# 2-core AMD EPYC (Zen 4, native bf16) VM, 0.104-0.112 s in 4 runs; 0.099-0.111 s there with
# AVX2 only (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, the slower class's instruction set:
# fp32 is not what it slows).
REFERENCE_WORKLOAD_S = 0.11


def workload_seconds() -> float:
    """A fixed torch workload: 4 forward+backward passes of gpulab's LeNet on a batch of 64, fp32,
    one thread; the best of 3 (a moment of load on a shared machine does not count)."""
    generator = torch.Generator().manual_seed(0)
    model = models.build("lenet")
    X, y = torch.randn(64, 1, 28, 28, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    best = float("inf")
    with one_thread():
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(4):
                model.zero_grad()
                nn.functional.cross_entropy(model(X), y).backward()
            best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def slowness() -> float:
    """How many times slower than the reference machine this one is, measured once per session
    (~0.35 s): 1.0 on the reference machine, the same with AVX2 only, or a faster one; more on a
    slower CPU. $GPULAB_TEST_SLOWNESS sets it instead (a number >= 1)."""
    given = os.environ.get("GPULAB_TEST_SLOWNESS")
    if given:
        return max(1.0, float(given))
    return max(1.0, workload_seconds() / REFERENCE_WORKLOAD_S)


def scaled(seconds: float) -> float:
    """A test's timeout for this machine: `seconds`, set on the reference machine, times slowness().
    For the limits that only end a test that would otherwise hang (subprocess timeouts, waits for
    a file) and bounds that include starting processes; not for the bounds a feature promises
    (a job stopped within N s of a signal)."""
    return seconds * slowness()


def pytest_report_header(config):
    return f"gpulab: machine slowness {slowness():.2f} (timeouts x that; tests/conftest.py:slowness)"


@pytest.fixture(scope="session")
def machine_slowness() -> float:
    """slowness(), for tests that take it as a fixture."""
    return slowness()


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
