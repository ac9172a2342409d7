"""What a recorded process does at its exit (record/attach.py), on real threads."""

import ctypes
import hashlib
import os
import threading

import pytest

from gpulab.monitor.record.attach import GLOO_WORKER, let_gloo_workers_finish

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")

_PR_SET_NAME = 15


def start_worker(busy_bytes: int) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """A thread under gloo's worker name that hashes `busy_bytes` without the GIL (runnable, as a
    gloo worker letting go of a finished collective is), then sleeps until released."""
    data = bytes(busy_bytes)
    started, finished_busy, release = threading.Event(), threading.Event(), threading.Event()

    def work():
        ctypes.CDLL(None).prctl(_PR_SET_NAME, GLOO_WORKER.encode(), 0, 0, 0)
        started.set()
        hashlib.sha256(data).digest()  # hashlib lets go of the GIL for large inputs
        finished_busy.set()
        release.wait()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    started.wait()
    return finished_busy, release, thread


def test_exit_waits_while_a_gloo_worker_is_runnable():
    finished_busy, release, thread = start_worker(400_000_000)  # ~0.2-1 s of hashing
    let_gloo_workers_finish(max_s=30)
    try:
        assert finished_busy.is_set()
    finally:
        release.set()
        thread.join()


def test_exit_never_waits_past_its_limit():
    finished_busy, release, thread = start_worker(2_000_000_000)  # seconds of hashing
    let_gloo_workers_finish(max_s=0.05)
    try:
        assert not finished_busy.is_set()
    finally:
        release.set()
        thread.join()
