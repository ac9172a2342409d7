"""The kernel window's arithmetic (cuda_hooks.kernel_statistics) on real profiler events.

On CPU the events come from torch.profiler itself: `record_function` produces the same user
annotation events (is_user_annotation() is True) that appear on the GPU track on a CUDA run, so
the filter runs on the real structure. The GPU-only shapes (a kernel track with annotations, the
profiler's closing cudaDeviceSynchronize) are replayed from a window recorded on an H100
(fixtures/kineto_h100_annotated_step.json, written by .gpu-style capture in scripts/gpu_check.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gpulab.monitor.cuda_hooks import _asks_non_blocking, kernel_statistics

FIXTURE = Path(__file__).parent / "fixtures" / "kineto_h100_annotated_step.json"
CPU = torch.autograd.DeviceType.CPU


def test_an_annotation_around_idle_time_is_not_device_work():
    x = torch.randn(64, 64)
    torch.mm(x, x).tanh()  # warm-up: a process's first matmul initialises the BLAS (tens of ms)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("train_step"):  # what users wrap their step in
            for _ in range(5):
                x = torch.mm(x, x).tanh()
            time.sleep(0.05)  # the device (here: the CPU's ops) is idle while the host sleeps
            x = torch.mm(x, x)
    events = prof.profiler.kineto_results.events()
    assert any(e.is_user_annotation() and e.name() == "train_step" for e in events)  # the real structure
    stats = kernel_statistics(events, steps=1, device_type=CPU)
    # Counted as work, the annotation would make the busy time >= the 50 ms sleep.
    assert stats["device_busy_s_per_step"] < 0.025
    ops = [e for e in events if not e.is_user_annotation() and e.device_type() == CPU]
    assert stats["kernels_per_step"] == len(ops)


class RecordedEvent:
    """One kineto event as recorded on a GPU: the methods kernel_statistics reads."""

    def __init__(self, row: dict):
        self.row = row

    def name(self):
        return self.row["name"]

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self.row["device_type"] == "CUDA" else CPU

    def device_index(self):
        return self.row["device_index"]

    def start_ns(self):
        return self.row["start_ns"]

    def end_ns(self):
        return self.row["end_ns"]

    def is_user_annotation(self):
        return self.row["is_user_annotation"]


@pytest.fixture
def h100_window():
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE.name} not recorded yet (scripts/gpu_check.py writes it on a GPU)")
    data = json.loads(FIXTURE.read_text())
    return data, [RecordedEvent(r) for r in data["events"]]


def test_recorded_gpu_window_annotations_do_not_fill_the_idle_gaps(h100_window):
    data, events = h100_window
    annotations = [e for e in events if e.is_user_annotation() and e.device_type() == torch.autograd.DeviceType.CUDA]
    assert {e.name() for e in annotations} >= {"train_step"}  # the shape the fix is about
    stats = kernel_statistics(events, data["steps"], data["steps_end_ns"])
    kernels = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA and not e.is_user_annotation()
               and not e.name().startswith(("Memcpy", "Memset"))]
    assert stats["kernels_per_step"] == pytest.approx(len(kernels) / data["steps"])
    # Each step sleeps data["host_sleep_s"] on the host with nothing queued: at least that much idle.
    step_s = (data["steps_end_ns"] - data["steps_start_ns"]) / 1e9 / data["steps"]
    assert stats["device_busy_s_per_step"] < step_s - data["host_sleep_s"]


def test_recorded_gpu_window_the_profiler_s_closing_sync_is_not_the_user_s(h100_window):
    data, events = h100_window
    closing = [e for e in events if e.name() == "cudaDeviceSynchronize" and e.start_ns() >= data["steps_end_ns"]]
    assert closing  # leaving the profiler synchronizes the device: the shape the fix is about
    user = sum(e.end_ns() - e.start_ns() for e in events
               if e.name() in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
               and e.start_ns() < data["steps_end_ns"])
    stats = kernel_statistics(events, data["steps"], data["steps_end_ns"])
    assert stats["runtime_sync_s_per_step"] == pytest.approx(user / 1e9 / data["steps"])


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    (("cuda",), {}, False),
    (("cuda",), {"non_blocking": True}, True),
    (("cuda", torch.float16, True), {}, True),   # to(device, dtype, non_blocking)
    ((0, True), {}, True),                       # cuda(device, non_blocking)
    (("cuda",), {"non_blocking": False}, False),
])
def test_non_blocking_is_read_from_keyword_or_position(args, kwargs, expected):
    assert _asks_non_blocking(args, kwargs) is expected
