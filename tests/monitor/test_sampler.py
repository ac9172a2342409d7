"""The background sampler on whatever this machine has: CPU-only series without a GPU or NVML."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpulab.monitor.parent import sampler as sampler_module
from gpulab.monitor.parent.sampler import Sampler

PROCESS_KEYS = {"cpu_pct", "rss_mib", "threads", "workers", "workers_cpu_pct", "workers_rss_mib"}
CORE_KEYS = {"ran_s", "waited_s", "busy_ran_s", "busy_waited_s", "busy_threads", "cores", "cores_busy_s",
             "pressure_s"}


def wait_for_samples(s: Sampler, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(s.samples) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_samples_this_process_and_says_why_there_is_no_gpu_data():
    s = Sampler(interval_s=0.02).start()
    try:
        wait_for_samples(s, 3)
    finally:
        s.stop()
    assert len(s.samples) >= 3
    for row in s.samples:
        assert set(row) == {"t", "gpus", "proc", "cores"}
        assert PROCESS_KEYS <= set(row["proc"])
        if sys.platform.startswith("linux"):  # running totals of how the job's threads got the cores
            assert CORE_KEYS == set(row["cores"]) and row["cores"]["cores"] >= 1
        assert row["proc"]["rss_mib"] > 0 and row["proc"]["threads"] >= 1
        assert len(row["gpus"]) == len(s.gpu.gpus)
    times = [row["t"] for row in s.samples]
    assert times == sorted(times)
    summary = s.summary()
    assert summary["samples"] == len(s.samples) and summary["mean_cpu_cost_ms"] >= 0
    if not s.gpu.gpus:  # no GPU here: the report must say why
        assert summary["nvml"] != "ok"


def test_without_nvidia_ml_py_the_sampler_still_records_the_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    s = Sampler(interval_s=0.02).start()
    try:
        wait_for_samples(s, 2)
    finally:
        s.stop()
    assert s.gpu.status == "nvidia-ml-py is not installed"
    assert s.samples and all(row["gpus"] == [] and row["proc"] for row in s.samples)


def test_dataloader_workers_are_counted_as_children(monkeypatch):
    monkeypatch.setattr(sampler_module, "_SLOW_REFRESH_S", 0.0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        s = Sampler(interval_s=0.02).start()
        try:
            wait_for_samples(s, 3)
        finally:
            s.stop()
    finally:
        child.kill()
        child.wait()
    assert max(row["proc"]["workers"] for row in s.samples) >= 1
    assert max(row["proc"]["workers_rss_mib"] for row in s.samples) > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc schedstat")
def test_the_threads_of_the_job_s_children_count_as_the_job_s(monkeypatch):
    monkeypatch.setattr(sampler_module, "_SLOW_REFRESH_S", 0.0)
    busy = "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        s = Sampler(interval_s=0.05).start()
        try:
            child.wait()
            wait_for_samples(s, len(s.samples) + 1)
        finally:
            s.stop()
    finally:
        child.kill()
        child.wait()
    first, last = s.samples[0]["cores"], s.samples[-1]["cores"]
    assert last["ran_s"] - first["ran_s"] >= 0.5  # the child ran ~1 s (less on a busy machine)
    assert last["cores_busy_s"] - first["cores_busy_s"] >= 0.5  # and the machine's CPUs saw it


def test_a_process_that_is_gone_gives_empty_process_rows():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    s = Sampler(interval_s=0.02, pid=child.pid).start()
    try:
        wait_for_samples(s, 2)
    finally:
        s.stop()
    assert all(row["proc"] is None for row in s.samples)


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Sampler(interval_s=0)
