"""gpulab/host.py: glibc's malloc thresholds are fixed for training processes; the cores a process
may use (affinity, cgroup quota)."""

from __future__ import annotations

import ctypes
import json
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpulab import host

SRC = str(Path(__file__).resolve().parent.parent / "src")

# After fixing the thresholds a 1 MiB block comes from the heap; with glibc's defaults (nothing
# large freed yet) it is a mapping of its own. Which one glibc chose is the IS_MMAPPED bit (0x2)
# of the chunk's size field, the word before the block: counting the lines of /proc/self/maps
# misses a new mapping that the kernel merged with the one beside it.
PROBE = r"""
import ctypes, sys
from gpulab.host import fix_malloc_thresholds
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
fixed = fix_malloc_thresholds()
p = libc.malloc(1 << 20)
print(fixed, ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)
libc.free(p)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("setting, fixed", [(None, True), ("default", False)])
def test_freed_blocks_are_reused_instead_of_mapped_again(setting, fixed):
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("GPULAB_MALLOC", None)
    if setting:
        env["GPULAB_MALLOC"] = setting
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    reported, mmapped = done.stdout.split()
    assert reported == str(fixed)
    if fixed:
        assert mmapped == "0"  # served from the heap
    else:
        assert mmapped == "2"  # glibc's default: a fresh mmap for a 1 MiB block


# ----------------------------------------------------------------------------- usable cores


def test_the_smallest_cgroup_quota_above_the_process_counts(tmp_path):
    """v2 (cpu.max) and v1 (cfs quota/period), the cgroup's own and its parents'; "max" and -1
    mean none; a path this container does not see is skipped."""
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")
    assert host.cgroup_quota(["0::/job/step"], tmp_path) == 2.5
    v1 = tmp_path / "cpu,cpuacct" / "pod"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert host.cgroup_quota(["4:cpu,cpuacct:/pod/hidden", "0::/job/step"], tmp_path) == 1.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert host.cgroup_quota(["4:cpu,cpuacct:/pod", "2:memory:/pod"], tmp_path) is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity masks here")
def test_usable_cores_are_the_affinity_capped_by_the_quota_rounded_up(monkeypatch):
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda pid=0: 0.5)
    assert host.usable_cores() == 1
    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda pid=0: 1.5)
    assert host.usable_cores() == min(affinity, 2)
    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda pid=0: None)
    assert host.usable_cores() == affinity


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
_PR_SET_NAME = 15


def start_worker(busy_bytes: int) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """A thread under gloo's worker name that hashes `busy_bytes` without the GIL (runnable, as a
    gloo worker letting go of a finished collective is), then sleeps until released."""
    data = bytes(busy_bytes)
    started, finished_busy, release = threading.Event(), threading.Event(), threading.Event()

    def work():
        ctypes.CDLL(None).prctl(_PR_SET_NAME, host.GLOO_WORKER.encode(), 0, 0, 0)
        started.set()
        hashlib.sha256(data).digest()  # hashlib lets go of the GIL for large inputs
        finished_busy.set()
        release.wait()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    started.wait()
    return finished_busy, release, thread


@needs_proc
def test_the_wait_for_gloo_workers_lasts_while_one_is_runnable():
    finished_busy, release, thread = start_worker(400_000_000)  # ~0.2-1 s of hashing
    host.let_gloo_workers_finish(max_s=30)
    try:
        assert finished_busy.is_set()
    finally:
        release.set()
        thread.join()


@needs_proc
def test_the_wait_for_gloo_workers_never_passes_its_limit():
    finished_busy, release, thread = start_worker(400_000_000)
    host.let_gloo_workers_finish(max_s=0.01)
    try:
        assert not finished_busy.is_set()
    finally:
        release.set()
        thread.join()


def test_seconds_since_start_is_the_time_since_the_process_was_spawned():
    """What a child says it has waited since its creation is what its parent measured since the
    spawn (the kernel counts in 10 ms ticks; psutil's creation time alone can be up to 1 s off)."""
    code = ("import json, time; t = time.time(); from gpulab.host import seconds_since_start; "
            "time.sleep(0.3); print(json.dumps([time.time(), seconds_since_start()]))")
    spawned = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    now, since_start = json.loads(done.stdout)
    assert since_start == pytest.approx(now - spawned, abs=0.05)
