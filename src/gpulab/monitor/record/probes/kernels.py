"""The kernel window probe: after warm-up, a few steps captured with torch's profiler (CUDA only:
a CUDA device present, and the script using it): kernels per step, their median duration, and
the time the device computed per step (a launch-bound loop shows many short kernels and a device
idle between them).

The profiler is torch.autograd.profiler's (kineto, the same events), not torch.profiler's: that
one imports torch._inductor at its first start to read one setting (1.1-1.4 s inside the loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gpulab.io import native_stderr_hidden
from gpulab.monitor.events import KernelsRecord
from gpulab.monitor.record.probe import WindowProbe
from gpulab.monitor.record.probes.cuda import cuda_device_present
from gpulab.signals import threads_started_inside_block_signals

_RUNTIME_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class KernelProbe(WindowProbe):
    """The profiler over `num_steps` steps after `after_step`, the first window to take its turn;
    one "kernels" record. A forked lane goes on with its parent's window: one that ran there does
    not run again. `device_type`: whose kernels to count - "cuda", or "cpu" in tests (its ops stand
    for kernels; `emit` takes the record)."""

    def __init__(self, after_step: int, num_steps: int, device_type: str = "cuda",
                 emit: Callable[[dict], None] | None = None):
        self.after_step, self.num_steps, self.device_type = after_step, num_steps, device_type
        self._emit = emit
        self.enabled = device_type != "cuda"  # CUDA: with a device present, once installed
        self.active = False
        self.done = num_steps == 0
        self._prof = None
        self._started_at = 0

    def hook(self) -> None:
        self._emit = self.sink.emit
        self.enabled = cuda_device_present()

    @property
    def finished(self) -> bool:
        return not self.enabled or self.done

    @property
    def holds_back_later_windows(self) -> bool:
        """Running, or about to: it goes first whenever the script uses CUDA."""
        return self.active or (not self.done and self.enabled and torch.cuda.is_initialized())

    def on_step_end(self, steps_done: int, may_open: bool = True) -> None:
        if not self.enabled or self.done:
            return
        in_use = self.device_type != "cuda" or torch.cuda.is_initialized()
        if not self.active and steps_done >= self.after_step and in_use:
            self._start(steps_done)
        elif self.active and steps_done - self._started_at >= self.num_steps:
            self._stop(steps_done)

    def finish(self) -> None:
        if self.active:
            self._stop(self.sink.steps_done)

    def _start(self, steps_done: int) -> None:
        use_device = self.device_type if self.device_type != "cpu" else None
        try:
            self._prof = torch.autograd.profiler.profile(use_device=use_device, use_kineto=True)
            with native_stderr_hidden(), threads_started_inside_block_signals():
                self._prof.__enter__()
        except Exception as e:  # CUPTI missing or busy (another profiler): no kernel statistics
            self._give_up(e)
            return
        self.active = True
        self._started_at = steps_done

    def _stop(self, steps_done: int) -> None:
        self.active = False
        self.done = True
        steps = steps_done - self._started_at
        # The window's steps end now. Leaving the profiler synchronizes the device; that wait, and
        # the one below, are gpulab's, so runtime syncs that start after this instant are not
        # counted (kineto's timestamps are wall-clock ns, like time.time_ns()).
        steps_end_ns = time.time_ns()
        try:
            with native_stderr_hidden():
                # Let every GPU finish the window's kernels while the profiler still records them:
                # leaving the profiler synchronizes only the current device.
                if self.device_type == "cuda":
                    for index in range(torch.cuda.device_count()):
                        if torch.cuda.memory_allocated(index):
                            torch.cuda.synchronize(index)
                self._prof.__exit__(None, None, None)
            device_type = torch.autograd.DeviceType.CUDA if self.device_type == "cuda" else torch.autograd.DeviceType.CPU
            record = kernel_statistics(self._prof.kineto_results.events(), steps, steps_end_ns, device_type)
        except Exception as e:
            self._give_up(e)
            return
        finally:
            self._prof = None
        if record is not None:
            self._emit(record)

    def _give_up(self, error: Exception) -> None:
        self.active = False
        self.done = True
        self._emit({"type": "kernels", "error": f"{type(error).__name__}: {error}"})


def kernel_statistics(events, steps: int, steps_end_ns: int | None = None,
                      device_type=torch.autograd.DeviceType.CUDA) -> KernelsRecord | None:
    """Kernels per step, their durations, and device-busy time per step, from kineto events.

    `record_function` ranges (user annotations, and the `Optimizer.step#...` one torch opens every
    step) appear on the GPU track too, spanning their first to last kernel: they are no kernels,
    and counted as such would fill the idle gaps. Runtime syncs that start after `steps_end_ns`
    are the profiler's own drain, not the user's."""
    if steps <= 0:
        return None
    kernels: dict[int, list[tuple[int, int]]] = {}  # per device: (start, end) in ns
    memcpy_ns = pageable = sync_ns = 0
    for e in events:
        name = e.name()
        start, end = e.start_ns(), e.end_ns()
        if _is_user_annotation(e):
            continue
        if e.device_type() == device_type:
            if name.startswith("Memcpy"):
                memcpy_ns += end - start
                pageable += "Pageable" in name
            elif not name.startswith("Memset"):
                kernels.setdefault(e.device_index(), []).append((start, end))
        elif name in _RUNTIME_SYNCS and (steps_end_ns is None or start < steps_end_ns):
            sync_ns += end - start
    # "Busy" means computing: a copy engine moving a batch leaves the SMs idle (NVML agrees:
    # its utilization counts kernels only).
    busy = {index: _union_ns(intervals) / 1e9 / steps for index, intervals in kernels.items()}
    durations = sorted(end - start for intervals in kernels.values() for start, end in intervals)
    return {
        "type": "kernels",
        "steps": steps,
        "kernels_per_step": len(durations) / steps,
        "kernel_median_us": durations[len(durations) // 2] / 1e3 if durations else None,
        "kernel_p90_us": durations[int(len(durations) * 0.9)] / 1e3 if durations else None,
        "device_busy_s_per_step": max(busy.values()) if busy else 0.0,
        "device_busy_s_per_step_by_device": {str(k): v for k, v in busy.items()},
        "memcpy_s_per_step": memcpy_ns / 1e9 / steps,
        "memcpy_pageable_per_step": pageable / steps,
        "runtime_sync_s_per_step": sync_ns / 1e9 / steps,
    }


def _is_user_annotation(event) -> bool:
    is_annotation = getattr(event, "is_user_annotation", None)  # torch >= 2.3
    if is_annotation is not None:
        return bool(is_annotation())
    return event.name().startswith(("Optimizer.step#", "Optimizer.zero_grad#", "ProfilerStep#"))


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end_so_far = 0, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            total += end - start
            end_so_far = end
        elif end > end_so_far:
            total += end - end_so_far
            end_so_far = end
    return total
