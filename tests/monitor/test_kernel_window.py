"""The kernel window's arithmetic (cuda_hooks.kernel_statistics) on real profiler events.

On CPU the events come from torch.profiler itself: `record_function` produces the same user
annotation events (is_user_annotation() is True) that appear on the GPU track on a CUDA run, so
the filter runs on the real structure. The GPU-only shapes (annotations on the kernel track, the
profiler's closing cudaDeviceSynchronize) were recorded on an H100 and are laid out by hand here;
tests/monitor/test_gpu.py checks the same on a real GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gpulab.monitor.record.probes.cuda import _asks_non_blocking
from gpulab.monitor.record.probes.kernels import kernel_statistics

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
    step = next(e for e in events if e.is_user_annotation() and e.name() == "train_step")  # the real structure
    step_s = (step.end_ns() - step.start_ns()) / 1e9
    stats = kernel_statistics(events, steps=1, device_type=CPU)
    # No op runs during the sleep, so the busy time leaves out at least its 50 ms, however slowly a
    # loaded machine runs the ops; counted as work, the annotation would make it the whole step.
    assert stats["device_busy_s_per_step"] <= step_s - 0.049
    ops = [e for e in events if not e.is_user_annotation() and e.device_type() == CPU]
    assert stats["kernels_per_step"] == len(ops)


class Event:
    """A kineto event with the methods kernel_statistics reads."""

    def __init__(self, name, device, start_us, dur_us, annotation=False):
        self._name, self._device, self._annotation = name, device, annotation
        self._start, self._end = int(start_us * 1e3), int((start_us + dur_us) * 1e3)

    def name(self):
        return self._name

    def device_type(self):
        return self._device

    def device_index(self):
        return 0

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def is_user_annotation(self):
        return self._annotation


def h100_like_window(steps: int = 3):
    """A window laid out by hand with the event shapes recorded on an H100 (torch 2.11, see
    benchmarks/results/h100-2026-11-24-before-fixes/facts.json): per step, the user's
    `train_step` annotation and torch's `Optimizer.step#SGD.step` on the GPU track
    (DeviceType.CUDA, is_user_annotation() True) spanning their kernels, a blocking copy's
    cudaStreamSynchronize on the CPU track; after the last step, the cudaDeviceSynchronize that
    leaving the profiler records. Each step: 3 kernels of 100 us with 2 ms of host work between
    the forward's and the backward's (the device idles), 4 ms of host sleep before the next."""
    cuda = torch.autograd.DeviceType.CUDA
    events, t = [], 0.0
    for _ in range(steps):
        k = [(t + 4000, 100), (t + 6100, 100), (t + 6300, 100)]
        events += [Event("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n", cuda, s, d) for s, d in k]
        events.append(Event("train_step", cuda, k[0][0], k[-1][0] + k[-1][1] - k[0][0], annotation=True))
        events.append(Event("Optimizer.step#SGD.step", cuda, k[-1][0], 100, annotation=True))
        events.append(Event("cudaStreamSynchronize", CPU, t + 3900, 25))
        t += 6500
    steps_end_us = t
    events.append(Event("cudaDeviceSynchronize", CPU, steps_end_us + 50, 27))
    return events, steps_end_us * 1000


def test_annotations_on_the_gpu_track_do_not_fill_its_idle_gaps():
    events, end_ns = h100_like_window()
    stats = kernel_statistics(events, 3, end_ns)
    assert stats["kernels_per_step"] == 3
    assert stats["device_busy_s_per_step"] == pytest.approx(300e-6)  # not the annotation's 2.4 ms span


def test_the_profiler_s_closing_sync_is_not_the_user_s():
    events, end_ns = h100_like_window()
    stats = kernel_statistics(events, 3, end_ns)
    assert stats["runtime_sync_s_per_step"] == pytest.approx(25e-6)  # the copy's sync only, not the 27 us drain


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    (("cuda",), {}, False),
    (("cuda",), {"non_blocking": True}, True),
    (("cuda", torch.float16, True), {}, True),   # to(device, dtype, non_blocking)
    ((0, True), {}, True),                       # cuda(device, non_blocking)
    (("cuda",), {"non_blocking": False}, False),
])
def test_non_blocking_is_read_from_keyword_or_position(args, kwargs, expected):
    assert _asks_non_blocking(args, kwargs) is expected


WINDOW_WITHOUT_DYNAMO = """
import json, sys, torch
from gpulab.monitor.record.probes.kernels import KernelProbe
records = []
window = KernelProbe(after_step=1, num_steps=2, device_type="cpu", emit=records.append)
x = torch.randn(64, 64)
for step in range(1, 5):
    x = torch.mm(x, x).tanh()
    window.on_step_end(step)
print(json.dumps({"records": records, "inductor": "torch._inductor" in sys.modules}))
"""


def test_the_kernel_window_counts_a_real_profile_without_importing_inductor():
    # torch.profiler's first start imports torch._inductor (1.1-1.4 s, inside the training loop).
    done = subprocess.run([sys.executable, "-c", WINDOW_WITHOUT_DYNAMO], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    (record,) = out["records"]
    assert "error" not in record and record["steps"] == 2 and record["kernels_per_step"] >= 2
    assert out["inductor"] is False
