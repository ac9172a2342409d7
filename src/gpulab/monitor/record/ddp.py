"""DistributedDataParallel's own timers for its backward (it samples some iterations): how long
its bucket allreduces ran and how much of that overlapped the backward computation. The rest,
the exposed part, is time backward spent waiting for communication, inside C++, where the
recorder cannot see it (analyze/ moves it from compute to collective)."""

from __future__ import annotations

import time
import weakref

import torch

_READ_EVERY_S = 0.2


class DdpTimers:
    """Read while the DDP module lives (at step ends, at most every _READ_EVERY_S) and kept: a
    script's DDP is often gone by the time the recorder stops."""

    def __init__(self):
        self._modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._stats: dict | None = None
        self._read_at = float("-inf")

    def note_module(self, module: torch.nn.Module) -> None:
        """A top-level module call: the timers are read from DDP modules."""
        if torch.distributed.is_available():
            from torch.nn.parallel import DistributedDataParallel

            if isinstance(module, DistributedDataParallel):
                self._modules.add(module)

    @property
    def seen(self) -> bool:
        return bool(self._modules)

    @property
    def latest(self) -> dict | None:
        """The latest reading, not read anew (safe from another thread)."""
        return self._stats

    def stats(self) -> dict | None:
        """The latest reading (read now if it is due; from the training thread only: DDP's
        reducer may be running)."""
        ddp = next(iter(self._modules), None)
        if ddp is None or time.perf_counter() - self._read_at < _READ_EVERY_S:
            return self._stats
        self._read_at = time.perf_counter()
        try:
            data = ddp._get_ddp_logging_data()
        except Exception:  # a private API: gone or changed in this torch
            return None
        comm_ns = data.get("avg_backward_comm_time") or 0
        if comm_ns <= 0:
            return self._stats  # no iteration sampled yet
        overlap_ns = data.get("avg_backward_compute_comm_overlap_time") or 0
        self._stats = {"avg_backward_comm_s": comm_ns / 1e9, "avg_overlap_s": overlap_ns / 1e9,
                       "exposed_comm_s": max(comm_ns - overlap_ns, 0) / 1e9,
                       "avg_backward_compute_s": (data.get("avg_backward_compute_time") or 0) / 1e9,
                       "bucket_cap_bytes": data.get("bucket_cap_bytes"), "backend": data.get("backend_name")}
        return self._stats
