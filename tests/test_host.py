"""gpulab/host.py: glibc's malloc thresholds are fixed for training processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")

# After fixing the thresholds a 1 MiB block comes from the heap (no new mapping); with glibc's
# defaults (nothing large freed yet) it is a mapping of its own.
PROBE = r"""
import ctypes, sys
from gpulab.host import fix_malloc_thresholds
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
fixed = fix_malloc_thresholds()
def maps():
    return sum(1 for _ in open("/proc/self/maps"))
before = maps()
p = libc.malloc(1 << 20)
print(fixed, maps() - before)
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
    reported, new_maps = done.stdout.split()
    assert reported == str(fixed)
    if fixed:
        assert int(new_maps) == 0  # served from the heap
    else:
        assert int(new_maps) >= 1  # glibc's default: a fresh mmap for a 1 MiB block
