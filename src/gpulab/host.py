"""Facts and settings of the host (CPU) side of a training process: the cores it may use, and
its memory allocator, glibc malloc with fixed thresholds.

glibc serves a large allocation (by default >= 128 KiB) with a fresh mmap and returns it to the
kernel when freed, so the next step's allocation of the same size page-faults and zeroes its
pages all over again. glibc raises that threshold on its own only after a large mmapped block
has been freed, so whether a CPU training step pays this cost depends on what the process
happened to allocate and free before. Seen here while building `gpulab plan`: two in-step
copies of LeNet's step (1 thread each) took 31-32 ms after loading a 43,520-image copy of
Fashion-MNIST and 24-26 ms after loading the whole set, and 24-25 ms with either once
MALLOC_MMAP_THRESHOLD_ was fixed; the committed side-by-side benchmark on a 10,240-image copy
(benchmarks/host_allocator.py) shows a smaller effect, 1.08x [0.95 .. 1.14] over 3 rounds.
Fixing the thresholds gives every process the fast case: blocks up to MMAP_THRESHOLD come from
the heap, and the heap is not trimmed below TRIM_THRESHOLD, so freed activations are reused
step after step (what PyTorch's CPU performance guide gets from jemalloc or tcmalloc). GPU
memory is not affected (the CUDA caching allocator keeps its blocks).

Set GPULAB_MALLOC=default to leave glibc's behaviour alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 * 2**20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # glibc's own rule when it raises the threshold itself


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where there is no glibc
    (macOS, musl) or GPULAB_MALLOC=default asks to leave them."""
    if os.environ.get("GPULAB_MALLOC") == "default":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a container)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
