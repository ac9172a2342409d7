"""The peak memory of a stretch of training (an epoch), per device, cheap enough to read every
epoch. CUDA's allocator keeps its own peak of torch's tensors (`max_memory_allocated`, reset
with `reset_peak_memory_stats`). A CPU has no such count: there the figure is the process's
peak resident memory (VmHWM in /proc/self/status, reset by writing 5 to /proc/self/clear_refs):
everything the process holds - Python, the libraries, a dataset in memory - not torch's tensors
alone; where the reset is refused it is the peak since the process started."""

from __future__ import annotations

import resource

import torch

def reset_peaks(devices: list[torch.device]) -> bool:
    """Start counting the peak anew on every device; False when the CPU's could not be reset."""
    reset = True
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                reset = False
    return reset


def peak_memory(devices: list[torch.device]) -> dict[str, int]:
    """{"cuda:0": bytes, ...} or {"cpu": bytes}: the peak since reset_peaks, one entry per device."""
    peaks = {}
    for device in dict.fromkeys(devices):
        peaks[str(device)] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss()
    return peaks


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB since the start
